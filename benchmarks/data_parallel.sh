#!/usr/bin/env bash
# `roseinfer serve --data-parallel-size 2` (two replicas on Ray, one thread each, prefix-affinity or
# round-robin routing) against one engine with both threads, with `roseinfer bench serve` on the
# random and shared-prefix datasets; each run gets a fresh server, and prints the bench summary and
# the prompt tokens served from the prefix cache (summed over replicas from /metrics).
# Run from the repository root: bash benchmarks/data_parallel.sh  (ROSEINFER="python -m roseinfer.cli"
# for a checkout that is not installed).
set -euo pipefail
ROSEINFER=${ROSEINFER:-roseinfer}
PORT=${PORT:-18650}
URL=http://127.0.0.1:$PORT
RANDOM_ARGS="--dataset random --num-prompts 64 --request-rate 4 --input-len 32 --output-len 64 --ignore-eos"
SHARED_ARGS="--dataset shared-prefix --num-prefixes 8 --num-prompts 64 --input-len 200 --output-len 16 --ignore-eos"

run() {  # run LABEL "BENCH ARGS" SERVE FLAGS...
    local label=$1 bench=$2
    shift 2
    $ROSEINFER serve --port "$PORT" --log-level warning "$@" > "/tmp/roseinfer_dp_$label.log" 2>&1 &
    local pid=$!
    until curl -sf "$URL/health" > /dev/null; do
        kill -0 "$pid" 2> /dev/null || { echo "server for $label died: /tmp/roseinfer_dp_$label.log"; exit 1; }
        sleep 1
    done
    echo "=== $label: serve $* ; bench serve $bench"
    $ROSEINFER bench serve --base-url "$URL" --no-progress $bench
    curl -s "$URL/metrics" | awk '/^roseinfer_prefix_cache_hits_total/ {h += $NF}
        /^roseinfer_prefix_cache_queries_total/ {q += $NF}
        END {printf "prefix cache: %d / %d prompt tokens (%.1f %%)\n", h, q, q ? 100 * h / q : 0}'
    kill -INT "$pid"
    wait "$pid" || true
}

run single-random "$RANDOM_ARGS" --num-threads 2
run dp2-random "$RANDOM_ARGS" --num-threads 1 --data-parallel-size 2
run single-shared "$SHARED_ARGS" --num-threads 2
run dp2-affinity-shared "$SHARED_ARGS" --num-threads 1 --data-parallel-size 2 --router prefix-affinity
run dp2-round-robin-shared "$SHARED_ARGS" --num-threads 1 --data-parallel-size 2 --router round-robin
