"""The --floor report of `bench offline`: floor samples (decode and prefill) around the measured
runs, and one Markdown row per batch size with the engine's and HF's throughput beside them."""
from __future__ import annotations

import argparse
import math
import statistics
from typing import TYPE_CHECKING, Any, Callable

from roseinfer.bench.floor import matmul_floor, prefill_matmul_floor
from roseinfer.config import prefill_step_tokens

if TYPE_CHECKING:
    from roseinfer.bench.offline import RoseinferRunner, RunResult


def floor_mode_for(modes: list[str]) -> str:
    """The mode the floor table compares: offline (LLM.generate), else online."""
    for mode in ("offline", "online"):
        if mode in modes:
            return mode
    raise ValueError("--floor compares batched runs: use --mode offline, online or all")


def prefill_only(args: argparse.Namespace, result: RunResult) -> bool:
    """True when the time to the run's last first token is prefill work only: every request was
    admitted and prefilled in the first engine step, or no request decoded at all (each got one
    token, so a prefill spread over several steps had no decode rows mixed into them)."""
    n = len(result.timings)
    if result.mode == "naive" or n > result.batch_size:
        return False
    if result.completion_tokens == n:
        return True
    budget = prefill_step_tokens(args.max_num_batched_tokens, args.prefill_max_tokens)
    return (result.prompt_tokens <= budget and n <= (args.prefill_max_batch_size or n)
            and n <= (args.max_active_requests or n))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def run_floor(run: RunResult, floor: float | None, prefill_floor: float | None) -> float | None:
    """Completion tokens/s of a run that did only its matmuls at both floors: every prompt token
    at the prefill floor (which includes each request's first token, from the LM head on its last
    position) and every later token at the decode floor. The e2e figure's own ceiling: e2e/floor
    divides a run that includes its prefill by a decode-only rate."""
    if not floor or not prefill_floor:
        return None
    later_tokens = run.completion_tokens - len(run.timings)
    return run.completion_tokens / (run.prompt_tokens / prefill_floor + later_tokens / floor)


def floor_rows(args: argparse.Namespace, results: list[RunResult], floors: dict[int, list[float]],
               prefill_floors: dict[int, list[float]], mode: str,
               memory: dict[int, dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """One row per batch size: medians over the repeat runs and over the floor samples, and the
    engine's peak RSS against its budget where it was measured (`bench/memory.py`)."""
    rows = []
    for bs, samples in floors.items():
        runs = [r for r in results if (r.backend, r.mode, r.batch_size) == ("roseinfer", mode, bs)]
        hf_runs = [r for r in results if (r.backend, r.mode, r.batch_size) == ("hf", mode, bs)]
        floor = _median(samples)
        # runs with no decode phase (--max-new-tokens 1) have no decode figure, not 0 tok/s, and
        # their one token per request over a decode floor compares nothing: no e2e/floor either
        decode_runs = [r.decode_throughput for r in runs if r.decode_tokens]
        decode = _median(decode_runs)
        e2e = _median([r.throughput(r.total_time) for r in runs])
        clean = [r for r in runs if prefill_only(args, r)]
        prefill = _median([r.prefill_throughput for r in clean]) if clean and len(clean) == len(runs) else None
        prefill_samples = prefill_floors.get(bs, [])
        prefill_floor = _median(prefill_samples)
        both_floors = _median([tok_s for r in runs if (tok_s := run_floor(r, floor, prefill_floor)) is not None])
        rows.append({
            "batch_size": bs, "mode": mode, "num_requests": len(runs[0].timings) if runs else 0,
            "runs": len(runs), "engine_decode_tok_s": decode, "floor_tok_s": floor,
            "decode_over_floor": _ratio(decode, floor), "e2e_tok_s": e2e,
            "e2e_over_floor": _ratio(e2e, floor) if decode is not None else None,
            "run_floor_tok_s": both_floors, "e2e_over_run_floor": _ratio(e2e, both_floors),
            "prefill_tok_s": prefill, "prefill_floor_tok_s": prefill_floor,
            "prefill_over_floor": _ratio(prefill, prefill_floor),
            "hf_tok_s": _median([r.throughput(r.total_time) for r in hf_runs]),
            "hf_decode_tok_s": _median([r.decode_throughput for r in hf_runs]),
            "floor_samples_tok_s": list(samples), "prefill_floor_samples_tok_s": list(prefill_samples),
            "engine_decode_runs_tok_s": decode_runs,
            "e2e_runs_tok_s": [r.throughput(r.total_time) for r in runs],
            **(memory or {}).get(bs, {}),
        })
    return rows


def _cell(value: float | None, spec: str) -> str:
    return "–" if value is None or not math.isfinite(value) else format(value, spec)


def format_floor_table(rows: list[dict[str, Any]], threads: int, steps: int) -> str:
    """The floor rows as a Markdown table (pasteable into a README)."""
    with_hf = any(r["hf_tok_s"] is not None for r in rows)
    with_prefill = any(r["prefill_tok_s"] is not None for r in rows)
    with_rss = any("peak_rss_mb" in r for r in rows)
    cols = ["batch", "engine decode tok/s", "floor tok/s", "decode/floor", "e2e tok/s", "e2e/floor",
            "run floor tok/s", "e2e/run floor"]
    cols += ["hf tok/s"] * with_hf + ["prefill tok/s", "prefill floor tok/s", "prefill/floor"] * with_prefill
    cols += ["peak RSS MB", "RSS budget MB"] * with_rss
    mode = rows[0]["mode"] if rows else "offline"
    out = [f"=== matmul floor (mode={mode}, threads={threads}, median over runs and floor samples) ===", "",
           "| " + " | ".join(cols) + " |", "|" + "|".join("-" * (len(c) + 1) + ":" for c in cols) + "|"]
    for r in rows:
        cells = [str(r["batch_size"]), _cell(r["engine_decode_tok_s"], ".1f"), _cell(r["floor_tok_s"], ".1f"),
                 _cell(r["decode_over_floor"], ".2f"), _cell(r["e2e_tok_s"], ".1f"),
                 _cell(r["e2e_over_floor"], ".2f"), _cell(r["run_floor_tok_s"], ".1f"),
                 _cell(r["e2e_over_run_floor"], ".2f")]
        cells += [_cell(r["hf_tok_s"], ".1f")] * with_hf
        if with_prefill:
            cells += [_cell(r["prefill_tok_s"], ".1f"), _cell(r["prefill_floor_tok_s"], ".1f"),
                      _cell(r["prefill_over_floor"], ".2f")]
        if with_rss:
            cells += [_cell(r.get("peak_rss_mb"), ".0f"), _cell(r.get("rss_budget_mb"), ".0f")]
        out.append("| " + " | ".join(cells) + " |")
    notes = [f"floor: tokens/s of a decode step doing only the model's matmuls (LM head included) on its own "
             f"weights (from one C loop where the engine's decode layers run in C), {steps} steps per sample, "
             "sampled before and after every measured run; "
             "engine decode: tokens after every request's first token / decode time; "
             "e2e: all completion tokens / total time (prefill included); "
             "run floor: the same completion tokens over the time of only the run's matmuls, its prompt "
             "tokens at the prefill floor (first tokens included) and every later token at the decode floor"]
    if with_hf:
        notes.append("hf: transformers generate, completion tokens / total time (same definition as e2e)")
    if with_rss:
        notes.append("peak RSS: the process's resident high-water mark from building the engine to the end of "
                     "its runs, the floor samples left out (an engine after the first of a run also carries what "
                     "the earlier ones left: oneDNN's per-shape caches and heap; one batch size per process gives "
                     "each its own figure); budget: weights + KV pool + 300 MB (shown only without --backend hf, "
                     "whose model would share the process)")
    if with_prefill:
        notes.append("prefill: prompt tokens / time to the last first token, shown where no decode work is "
                     "mixed into that time (the whole prefill fits in one step, or --max-new-tokens 1); "
                     "prefill floor: prompt tokens/s of only the matmuls of the same prefill (every layer but "
                     "the LM head on all prompt tokens, in steps of the engine's token budget; the LM head on "
                     "one row per prompt)")
    out += [""] + [f"{note}." for note in notes]
    return "\n".join(out)


def floor_sampler(args: argparse.Namespace, runner: RoseinferRunner, batch_size: int, num_prompts: int, mode: str,
                  samples: list[float], prefill_samples: list[float]) -> Callable[[str], None]:
    """The ``around_measured`` hook: one decode and one prefill floor sample for ``batch_size``
    on the engine's loaded model (same weights, dtype, device and threads), around each measured
    run of ``mode``. The prefill floor prefills a run's ``num_prompts`` prompts of ``--prompt-len``
    tokens in steps of the engine's prefill token budget."""
    engine = runner.engine
    model, config = engine.runner.model, engine.config
    step_tokens = prefill_step_tokens(config.max_num_batched_tokens, config.prefill_max_tokens)

    def sample(run_mode: str) -> None:
        if run_mode != mode:
            return
        tok_s = matmul_floor(model, engine.backend, batch_size, args.floor_steps, args.floor_warmup)
        samples.append(tok_s)
        print(f"Matmul floor (batch_size={batch_size}, sample {len(samples)}): {tok_s:.2f} tokens/s", flush=True)
        prefill_tok_s = prefill_matmul_floor(model, num_prompts, args.prompt_len, step_tokens)
        prefill_samples.append(prefill_tok_s)
        print(f"Prefill matmul floor (batch_size={batch_size}, sample {len(prefill_samples)}): "
              f"{prefill_tok_s:.2f} prompt tokens/s", flush=True)

    return sample
