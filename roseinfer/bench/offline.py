"""``bench offline``: the blog's benchmark_scheduler, batch throughput without a server.

Modes (``--mode``):

* ``naive``: one request at a time, each run to completion before the next is added.
* ``offline``: everything submitted at once, then run to completion through
  ``LLM.generate`` (the offline API users call).
* ``online``: everything submitted at once, then the engine is stepped by hand and each
  request's tokens are stamped as ``step()`` hands them over, for TTFT/TPOT/latency.

``--backend hf`` runs the same prompt ids through transformers' ``generate`` (greedy,
batched with left padding; see ``hf_runner``) for side-by-side tables.

Decode time = total time - prefill phase, where the prefill phase lasts until every
request has its first token (for ``naive``: the sum of each request's own time to first
token). Both throughputs count all completion tokens: ``completion,decode`` divides them by
the decode time, ``completion,total`` by the total time.

Each result is one ``RunResult``. What is printed (``offline_report``) is the blog's: per mode a
``=== MODE summary ===`` block over the measured runs (naive: each run's own block), with
``--print-per-run`` each run's block first; roseinfer's side-by-side table follows only when
asked for (``--detailed``, ``--backend`` with hf, ``--batch-sizes``).

By default the prefix cache is emptied before every run, as the blog does, so that no run reuses
what the one before cached; ``--keep-prefix-cache-across-runs`` keeps it (and gives every run the
same generated prompts, so that there is something to reuse).

``--floor`` puts the engine beside the matmul floor (``bench/floor.py``): a decode step that
does only the model's matmuls, LM head included, on the engine's own loaded weights, with the
engine's thread count. Per batch size B, B requests are submitted at once (unless
``--num-requests`` says otherwise), and while that engine is alive the floor for B is timed
before the first measured run and after every one (``--repeat-runs`` R gives R+1 samples,
interleaved with the engine's runs so that both see the same machine weather). The floor
table (``floor_rows``, Markdown) reports medians: the engine's decode throughput (tokens
produced after every request has its first token, over the decode time), its end-to-end
output throughput (all completion tokens over the total time, prefill included), the median
floor, both ratios to it, the run floor (the run's completion tokens over the time of only its
matmuls: prompt tokens at the prefill floor, later tokens at the decode floor) and the end-to-end
figure's ratio to it, HF's end-to-end figure when ``--backend`` includes hf, and the
prefill throughput (prompt tokens over the time to the last first token) where no decode
work is mixed into that time (the whole prefill fits in one engine step, or every request
stops at its first token, ``--max-new-tokens 1``), beside the
prefill floor (only the matmuls of prefilling the same prompts, sampled with the decode floor)
and its ratio to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from roseinfer.platforms import platform_for, resolve_device
from roseinfer.sampling_params import SamplingParams

from .datasets import random_requests
from .engine_flags import engine_config_from_flags, nvtx_range, sampling_params_from_flags
from .floor_report import floor_mode_for, floor_rows, floor_sampler, format_floor_table
from .memory import EnginePeakRss, engine_memory
from .metrics import RequestTiming
from .offline_args import BACKENDS, DEFAULT_NUM_REQUESTS, MODES
from .offline_report import format_spec_stats, format_stats, format_summary, format_table, summary_rows

class Runner(Protocol):
    """Runs one benchmark mode over token-id prompts; returns per-request timings."""

    name: str

    def run(self, mode: str, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]: ...

    def reset_prefix_cache(self) -> None: ...


@dataclass
class RunResult:
    backend: str
    mode: str
    batch_size: int
    prompt_tokens: int
    total_time: float
    prefill_time: float
    timings: list[RequestTiming] = field(repr=False)

    @property
    def completion_tokens(self) -> int:
        return sum(t.num_tokens for t in self.timings)

    @property
    def decode_time(self) -> float:
        return max(self.total_time - self.prefill_time, 0.0)

    @property
    def decode_tokens(self) -> int:
        """Completion tokens produced in the decode phase, i.e. after every request has its
        first token (for ``naive``: after each request's own first token). Counted from the
        token stamps where a run keeps one per token (``online``, hf); where it keeps only the
        first and last (``offline``), every token after a request's first, which is exact
        when the whole prefill took one step."""
        if self.mode == "naive":
            return sum(max(t.num_tokens - 1, 0) for t in self.timings)
        firsts = [t.first_token for t in self.timings if t.first_token is not None]
        if not firsts:
            return 0
        last_first = max(firsts)
        count = 0
        for t in self.timings:
            if len(t.token_times) == t.num_tokens:
                count += sum(stamp > last_first for stamp in t.token_times)
            else:
                count += max(t.num_tokens - 1, 0)
        return count

    @property
    def num_preemptions(self) -> int:
        return sum(t.num_preemptions for t in self.timings)

    @property
    def decode_throughput(self) -> float:
        """Decode-phase tokens over the decode time (the floor table's engine figure)."""
        return self.decode_tokens / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def prefill_throughput(self) -> float:
        return self.prompt_tokens / self.prefill_time if self.prefill_time > 0 else 0.0

    def throughput(self, seconds: float) -> float:
        return self.completion_tokens / seconds if seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "mode": self.mode, "batch_size": self.batch_size,
            "num_requests": len(self.timings), "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "total_time_s": self.total_time,
            "prefill_time_s": self.prefill_time, "decode_time_s": self.decode_time,
            "throughput_completion_decode": self.throughput(self.decode_time),
            "throughput_completion_total": self.throughput(self.total_time),
            "decode_tokens": self.decode_tokens, "throughput_decode_tokens": self.decode_throughput,
            "throughput_prefill": self.prefill_throughput, "num_preemptions": self.num_preemptions,
            "ttft_s": [t.ttft for t in self.timings], "tpot_s": [t.tpot for t in self.timings],
            "latency_s": [t.latency for t in self.timings],
        }


class RoseinferRunner:
    name = "roseinfer"

    def __init__(self, args: argparse.Namespace, batch_size: int) -> None:
        from roseinfer.llm import LLM

        if args.engine_process == "on":
            raise ValueError("bench offline steps the engine in this process: --engine-process on is for serve, "
                             "LLM and bench throughput")
        self.llm = LLM(**vars(engine_config_from_flags(args, max_num_seqs=batch_size)))
        self.engine = self.llm.engine

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def run(self, mode: str, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]:
        if mode == "naive":
            return [t for ids in prompts for t in self._step_all([ids], params)]
        if mode == "offline":
            return self._generate(prompts, params)
        return self._step_all(prompts, params)

    def _generate(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]:
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)  # no bar drawn inside the timed run
        timings = []
        for out in outs:
            # LLM.generate keeps only the first and the finishing token's times; with the
            # token count that is enough for TTFT, TPOT and latency.
            first, finished = out.metrics["first_token"], out.metrics["finished"]
            stamps = [first] if len(out.token_ids) < 2 else [first, finished]
            timings.append(RequestTiming(t0, t0, admitted=out.metrics["admitted"], token_times=stamps,
                                         end=finished, output_tokens=len(out.token_ids),
                                         num_preemptions=out.metrics["num_preemptions"]))
        return timings

    def _step_all(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]:
        engine = self.engine
        t0 = time.perf_counter()
        timings: dict[str, RequestTiming] = {}
        for ids in prompts:
            rid = engine.add_request(ids, params)
            timings[rid] = RequestTiming(submit_start=t0, submit_end=time.perf_counter())
        while engine.has_unfinished():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                timing = timings[out.request_id]
                timing.token_times.extend([now] * len(out.new_token_ids))
                if out.times is not None:
                    timing.admitted = out.times.admitted
                    timing.num_preemptions = out.times.num_preemptions
                if out.finished:
                    timing.end = now
        engine.pop_finished_ids()
        return list(timings.values())


def prefill_phase(mode: str, timings: list[RequestTiming], t0: float) -> float:
    firsts = [(t.submit_start, t.first_token) for t in timings if t.first_token is not None]
    if not firsts:
        return 0.0
    if mode == "naive":
        return sum(first - start for start, first in firsts)
    return max(first for _, first in firsts) - t0


def num_requests_for(args: argparse.Namespace, batch_size: int) -> int:
    """Requests per run: --num-requests, else one per --prompts text, else the batch size under
    --floor (one full batch, submitted at once), else 16."""
    if args.num_requests is not None:
        return args.num_requests
    if args.prompts:
        return len(args.prompts)
    return batch_size if getattr(args, "floor", False) else DEFAULT_NUM_REQUESTS


def build_prompts(args: argparse.Namespace, tokenizer: Any, run_index: int,
                  num_requests: int | None = None) -> list[list[int]]:
    """Token-id prompts for one run: --prompts cycled to the run's size, else --prompt n times, else
    generated. Generated prompts are drawn afresh per run (seed + run index), the same in every
    run with --keep-prefix-cache-across-runs."""
    n = num_requests if num_requests is not None else num_requests_for(args, args.max_num_seqs)
    if args.prompts:
        return [tokenizer.encode(args.prompts[i % len(args.prompts)]) for i in range(n)]
    if args.prompt is not None:
        return [tokenizer.encode(args.prompt)] * n
    seed = args.seed + (0 if args.keep_prefix_cache_across_runs else run_index)
    reqs = random_requests(n, args.prompt_len, 1, seed=seed, tokenizer=tokenizer)
    return [tokenizer.encode(r.prompt)[: args.prompt_len] for r in reqs]


def run_once(runner: Runner, mode: str, batch_size: int, prompts: list[list[int]],
             params: SamplingParams) -> RunResult:
    t0 = time.perf_counter()
    timings = runner.run(mode, prompts, params)
    total = time.perf_counter() - t0
    return RunResult(runner.name, mode, batch_size, sum(map(len, prompts)), total,
                     prefill_phase(mode, timings, t0), timings)


def _run_modes(args: argparse.Namespace, runner: Runner, batch_size: int, modes: list[str],
               tokenizer: Any, params: SamplingParams, tag: str,
               around_measured: Callable[[str], None] | None = None) -> list[RunResult]:
    """Warmup then measured runs of each mode, each mode's blocks printed as it ends; ``tag``
    follows the mode in their titles. ``around_measured(mode)``, when given, is called before a
    mode's first measured run and after each measured run (the floor)."""
    results = []
    n = num_requests_for(args, batch_size)
    for mode in modes:
        measured_runs = []
        for k in range(args.warmup_runs + args.repeat_runs):
            measured = k - args.warmup_runs
            if measured == 0 and around_measured is not None:
                around_measured(mode)
            prompts = build_prompts(args, tokenizer, k, n)
            if not args.keep_prefix_cache_across_runs:
                runner.reset_prefix_cache()
            with nvtx_range(args, f"{runner.name}/{mode}/bs{batch_size}/run{k}"):
                result = run_once(runner, mode, batch_size, prompts, params)
            if measured < 0:
                continue  # warmup: JIT, allocator and cache growth stay out of the numbers
            measured_runs.append(result)
            if mode == "naive" or args.print_per_run:
                print(format_stats(result, f"{mode}{tag}"), flush=True)
            if around_measured is not None:
                around_measured(mode)
        if mode != "naive":
            print(format_summary(f"{mode} summary{tag}", measured_runs, args.warmup_runs), flush=True)
        results += measured_runs
    return results


def run_offline_bench(args: argparse.Namespace) -> dict[str, Any]:
    from roseinfer.loader.default_model import DEFAULT_MODEL_NAME
    from roseinfer.loader.model_loader import resolve_model_folder
    from roseinfer.tokenizer import Tokenizer

    if args.warmup_runs < 0 or args.repeat_runs < 1:
        raise ValueError("--warmup-runs must be >= 0 and --repeat-runs >= 1")
    if (args.num_requests is not None and args.num_requests < 1) or args.prompt_len < 1:
        raise ValueError("--num-requests and --prompt-len must be >= 1")
    backends = list(BACKENDS) if "both" in args.backend else list(dict.fromkeys(args.backend))
    modes = list(MODES) if args.mode == "all" else [args.mode]
    floor = getattr(args, "floor", False)
    floor_mode = None
    if floor:
        if "roseinfer" not in backends:
            raise ValueError("--floor times the engine's own model: include the roseinfer backend")
        if args.floor_steps < 1 or args.floor_warmup < 0:
            raise ValueError("--floor-steps must be >= 1 and --floor-warmup >= 0")
        floor_mode = floor_mode_for(modes)
    args.device = resolve_device(args.device)
    batch_sizes = args.batch_sizes or [args.max_num_seqs]
    if args.num_threads:
        # the engine sets this itself, but an hf-only run builds no engine; torch's count
        # is process-wide, so both backends then run on the same number of threads
        torch.set_num_threads(args.num_threads)
    params = sampling_params_from_flags(args)
    if "hf" in backends and not params.greedy:
        raise ValueError("--backend hf runs transformers' generate greedy only: drop --do-sample/--temperature")
    # The blog's titles name the mode only; other backends or several batch sizes need theirs too.
    several = backends != ["roseinfer"] or len(batch_sizes) > 1
    hf = hf_tokenizer = None
    if "hf" in backends:
        from .hf_runner import HFRunner

        # transformers needs the fp32 folder; a roseinfer-only run converts none (a GGUF's is its
        # fp32 size on disk, several times the file's)
        folder = resolve_model_folder(args.model)
        hf_tokenizer = Tokenizer(folder)
        hf = HFRunner(folder, args.device, args.dtype, hf_tokenizer.eos_token_ids, batch_sizes[0])
    results: list[RunResult] = []
    floors: dict[int, list[float]] = {}
    prefill_floors: dict[int, list[float]] = {}
    memory: dict[int, dict[str, float]] = {}
    speculative: dict[int, dict[str, float]] = {}  # per batch size, with --speculative-config
    threads = torch.get_num_threads()
    for bs in batch_sizes:
        for backend in backends:
            # The engine is built per batch size (max_num_seqs is fixed at construction);
            # the HF model is loaded once and only re-batched.
            around = None
            if backend == "roseinfer":
                peak_rss = EnginePeakRss()
                runner: Runner = RoseinferRunner(args, bs)
                # Prompts come from the engine's own tokenizer: a second copy (~14 MiB resident)
                # would count against the engine's peak RSS, and a server holds one.
                tokenizer = runner.llm.tokenizer
                if floor:
                    around = peak_rss.excluding(floor_sampler(
                        args, runner, bs, num_requests_for(args, bs), floor_mode,
                        floors.setdefault(bs, []), prefill_floors.setdefault(bs, [])))
                    threads = torch.get_num_threads()  # the engine has set its own by now
            else:
                hf.batch_size = bs
                runner, tokenizer = hf, hf_tokenizer
            tag = f" | backend={backend} | batch_size={bs}" if several else ""
            results += _run_modes(args, runner, bs, modes, tokenizer, params, tag, around)
            if backend == "roseinfer" and runner.engine.config.speculative is not None:
                # warmup included: the counters are the engine's since it started
                speculative[bs] = runner.engine.speculative_stats()
                print(format_spec_stats(f"speculative decoding, all runs{tag}", speculative[bs]), flush=True)
            if backend == "roseinfer" and hf is None:  # with HF's model in the process the peak is not ours
                memory[bs] = engine_memory(runner.engine, peak_rss.bytes())
            # Drop this engine's KV pool (and tokenizer) before the next one sizes its own from free memory.
            del runner, tokenizer
            gc.collect()
            platform_for(torch.device(args.device)).empty_cache()
    rows = summary_rows(results)
    if args.detailed or "hf" in backends or args.batch_sizes is not None:
        print(format_table(rows, args.model or DEFAULT_MODEL_NAME, args.device), flush=True)
    report = {"args": {k: v for k, v in vars(args).items() if k != "func"},
              "runs": [r.to_dict() for r in results], "summary": rows}
    if speculative:
        report["speculative"] = speculative
    if floor:
        table = floor_rows(args, results, floors, prefill_floors, floor_mode, memory)
        print(format_floor_table(table, threads, args.floor_steps), flush=True)
        report["floor"] = {"mode": floor_mode, "threads": threads, "steps": args.floor_steps,
                           "warmup": args.floor_warmup, "rows": table}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return report
