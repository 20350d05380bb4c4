"""The blog's printed output ("从零实现 LLM Inference"), copied from its posts, and the mask that
compares it with ours: every number (not the digits in a name such as p50) becomes ``N``, with
``.`` and one ``d`` per decimal kept so that a changed number of decimals still shows, and the
model and device names become ``*``."""

from __future__ import annotations

import re

# benchmark_streaming --pretok --stream-interval 8, a 20 ms absolute schedule (the post on batched
# prefix lookups, "After").
STREAMING = """\
=== warmup 1/1 ===
=== streaming benchmark ===
Model: gpt2
Device: cuda
Pretok: True
Tokenize workers: 0
Stream interval: 8
Paged attention: False
CUDA Graph: False
NVTX: False
Requests: 64
Prompt tokens (total): 64
Completion tokens (total): 8192
Submit wall: 1.260339 s
Submit interval/schedule: 20.000 ms / absolute
Submit lag p50/p95/p99: 0.07/0.16/0.17 ms
add_request latency p50/p95/p99: 0.03/0.06/0.08 ms
Tokenize p50/p95/p99: 0.00/0.00/0.00 ms
Queue wait (post-tok) p50/p95/p99: 4.29/15.24/20.70 ms
Prefill->first token p50/p95/p99: 3.37/4.08/5.53 ms
TTFT p50/p95/p99: 7.60/18.62/24.86 ms
TPOT p50/p95/p99: 21.09/22.10/22.12 ms/token
ITL p50/p95/p99: 22.55/24.62/25.21 ms
Latency p50/p95/p99: 2687.46/2815.67/2821.78 ms
Throughput (completion,total): 2150.25 tokens/s
"""

# The same command line with --paged-attn --cuda-graph --nvtx, which print True, and
# --max-inflight-requests, whose two lines join the block where the post on backpressure prints them
# (Rejected after Requests, reject latency after add_request latency).
STREAMING_INFLIGHT = (
    STREAMING.replace("Paged attention: False\nCUDA Graph: False\nNVTX: False\n",
                      "Paged attention: True\nCUDA Graph: True\nNVTX: True\n")
    .replace("Requests: 64\n", "Requests: 64\nRejected: 192\n")
    .replace("Tokenize p50/p95/p99", "reject latency p50/p95/p99: 0.00/0.00/0.00 ms\nTokenize p50/p95/p99")
)

# benchmark_scheduler --mode online --warmup-runs 0 --repeat-runs 1 (the post on lazy deletion
# from the active queue).
SCHEDULER_ONLINE = """\
=== online summary ===
Warmup runs: 0
Measured runs: 1
Decode time p50/mean: 0.172318/0.172318 s
Total time p50/mean: 0.194708/0.194708 s
Throughput(completion,decode) p50/mean: 371.41/371.41 tokens/s
Throughput(completion,total) p50/mean: 328.70/328.70 tokens/s
TTFT p50/mean: 0.25/0.25 ms
TPOT p50/mean: 24.69/24.69 ms/token
Latency p50/mean: 173.08/173.08 ms

"""

# One measured online run's block, as the script's report_stats prints it (--print-per-run, before
# the summary), with the first run's numbers of the summary below (the post on batched KV
# writes, "Before").
_SCHEDULER_RUN = """\
=== online ===
Requests: 64
Elapsed (prefill/add): 0.173094 seconds
Elapsed (decode/run): 7.643991 seconds
Elapsed (total): 7.817085 seconds
Prompt tokens: 64
Completion tokens: 32768
Total tokens: 32832
Throughput (completion,total): 4191.84 tokens/s
Throughput (completion,decode): 4286.77 tokens/s
Throughput (total,total): 4200.03 tokens/s

"""

# --warmup-runs 1 --repeat-runs 3 --print-per-run.
SCHEDULER_PER_RUN = _SCHEDULER_RUN * 3 + """\
=== online summary ===
Warmup runs: 1
Measured runs: 3
Decode time p50/mean: 7.643991/7.639430 s
Total time p50/mean: 7.817085/7.813045 s
Throughput(completion,decode) p50/mean: 4286.77/4289.33 tokens/s
Throughput(completion,total) p50/mean: 4191.84/4194.01 tokens/s
TTFT p50/mean: 2.68/2.70 ms
TPOT p50/mean: 14.99/14.98 ms/token
Latency p50/mean: 7661.28/7659.60 ms

"""


# A naive run (each request alone): no post prints one, so this is what the script's report_stats
# prints for it, already masked.
SCHEDULER_NAIVE = """\
=== naive ===
Requests: N
Elapsed: N.dddddd seconds
Prompt tokens: N
Completion tokens: N
Total tokens: N
Throughput (completion,total): N.dd tokens/s
Throughput (total,total): N.dd tokens/s

"""


def _number(match: re.Match[str]) -> str:
    frac = match.group(1)
    return "N" if frac is None else "N." + "d" * len(frac)


def mask(text: str) -> list[str]:
    """The lines of ``text`` with model, device and every number masked."""
    text = re.sub(r"^(Model|Device): .*$", r"\1: *", text, flags=re.M)
    return re.sub(r"(?<![A-Za-z\d])\d+(?:\.(\d+))?", _number, text).split("\n")
