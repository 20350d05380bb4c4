"""What ``bench offline`` prints: the blog's blocks (its benchmark_scheduler's), and roseinfer's
side-by-side table.

* ``format_stats``: one run, the blog's ``=== online ===`` block. Printed for every naive run
  (the blog runs naive once and reports that run) and, with ``--print-per-run``, for every
  measured offline or online run.
* ``format_summary``: one mode over its measured runs, the blog's ``=== online summary ===``:
  median and mean of each run's figures; online adds TTFT, TPOT and latency (each run's p50).
* ``summary_rows`` / ``format_table``: roseinfer's table, one row per backend, mode and batch
  size (means over the repeat runs), printed only when asked for (``--detailed``, ``--backend``
  with hf, ``--batch-sizes``).

Each block ends with an empty line, as the blog's do.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from .metrics import format_p50_mean, percentiles_ms

if TYPE_CHECKING:
    from roseinfer.bench.offline import RunResult


def format_stats(r: RunResult, title: str) -> str:
    """One run. Naive runs have no prefill/decode split (each request runs alone), so they
    print one elapsed time and no decode throughput, as in the blog."""
    total_tokens = r.prompt_tokens + r.completion_tokens
    lines = [f"=== {title} ===", f"Requests: {len(r.timings)}"]
    if r.mode == "naive":
        lines.append(f"Elapsed: {r.total_time:.6f} seconds")
    else:
        lines += [f"Elapsed (prefill/add): {r.prefill_time:.6f} seconds",
                  f"Elapsed (decode/run): {r.decode_time:.6f} seconds",
                  f"Elapsed (total): {r.total_time:.6f} seconds"]
    lines += [f"Prompt tokens: {r.prompt_tokens}",
              f"Completion tokens: {r.completion_tokens}",
              f"Total tokens: {total_tokens}",
              f"Throughput (completion,total): {r.throughput(r.total_time):.2f} tokens/s"]
    if r.mode != "naive" and r.decode_time > 0:
        lines.append(f"Throughput (completion,decode): {r.throughput(r.decode_time):.2f} tokens/s")
    total_rate = total_tokens / r.total_time if r.total_time > 0 else 0.0
    lines.append(f"Throughput (total,total): {total_rate:.2f} tokens/s")
    return "\n".join(lines) + "\n"


def _p50_ms(values: list[float | None]) -> float:
    return percentiles_ms([v for v in values if v is not None], (50.0,))[0]


def format_summary(title: str, runs: list[RunResult], warmup_runs: int) -> str:
    """One mode over its measured runs (at least one)."""
    lines = [
        f"=== {title} ===",
        f"Warmup runs: {warmup_runs}",
        f"Measured runs: {len(runs)}",
        format_p50_mean("Decode time", [r.decode_time for r in runs], "s", 6),
        format_p50_mean("Total time", [r.total_time for r in runs], "s", 6),
        format_p50_mean("Throughput(completion,decode)", [r.throughput(r.decode_time) for r in runs], "tokens/s"),
        format_p50_mean("Throughput(completion,total)", [r.throughput(r.total_time) for r in runs], "tokens/s"),
    ]
    preemptions = [r.num_preemptions for r in runs]
    if any(preemptions):
        # a preempted request is recomputed: the run measures a KV pool too small for the batch
        lines.append(f"Preemptions: {', '.join(map(str, preemptions))} (the KV pool is smaller than the batch "
                     "needs: --num-kv-blocks or --kv-cache-memory-gb)")
    if runs[0].mode == "online":  # only the online mode stamps every token as the engine hands it over
        lines += [
            format_p50_mean("TTFT", [_p50_ms([t.ttft for t in r.timings]) for r in runs], "ms"),
            format_p50_mean("TPOT", [_p50_ms([t.tpot for t in r.timings]) for r in runs], "ms/token"),
            format_p50_mean("Latency", [_p50_ms([t.latency for t in r.timings]) for r in runs], "ms"),
        ]
    return "\n".join(lines) + "\n"


def format_spec_stats(title: str, stats: dict[str, float]) -> str:
    """The engine's speculative counters (LLMEngine.speculative_stats), over all its runs."""
    return "\n".join([
        f"=== {title} ===",
        f"Drafts: {stats['spec_num_drafts']}",
        f"Draft tokens: {stats['spec_num_draft_tokens']}",
        f"Accepted tokens: {stats['spec_num_accepted_tokens']}",
        f"Mean accepted length: {stats['spec_mean_accepted_length']:.3f}",
    ]) + "\n"


def summary_rows(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per (backend, mode, batch size): means over its repeat runs."""
    groups: dict[tuple[str, str, int], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.backend, r.mode, r.batch_size), []).append(r)
    rows = []
    for (backend, mode, bs), runs in groups.items():
        rows.append({
            "backend": backend, "mode": mode, "batch_size": bs, "runs": len(runs),
            "total_time_s": statistics.fmean(r.total_time for r in runs),
            "decode_time_s": statistics.fmean(r.decode_time for r in runs),
            "throughput_completion_decode": statistics.fmean(r.throughput(r.decode_time) for r in runs),
            "throughput_completion_total": statistics.fmean(r.throughput(r.total_time) for r in runs),
            "throughput_decode_tokens": statistics.fmean(r.decode_throughput for r in runs),
            "throughput_prefill": statistics.fmean(r.prefill_throughput for r in runs),
            "num_preemptions": sum(r.num_preemptions for r in runs),
        })
    return rows


def format_table(rows: list[dict[str, Any]], model: str, device: str) -> str:
    head = (f"{'backend':<10} {'mode':<8} {'batch':>5} {'runs':>4} {'total s':>9} {'decode s':>9} "
            f"{'tok/s (compl,decode)':>21} {'tok/s (compl,total)':>20}")
    out = ["=== summary (mean over repeat runs) ===", f"Model: {model}", f"Device: {device}", head]
    for r in rows:
        out.append(f"{r['backend']:<10} {r['mode']:<8} {r['batch_size']:>5} {r['runs']:>4} "
                   f"{r['total_time_s']:>9.3f} {r['decode_time_s']:>9.3f} "
                   f"{r['throughput_completion_decode']:>21.2f} {r['throughput_completion_total']:>20.2f}")
    return "\n".join(out)
