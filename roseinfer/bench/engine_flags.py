"""Engine and sampling flags shared by ``bench streaming`` and ``bench offline``.

The engine flags are EngineConfig's (engine_args.py generates them), under the roseinfer blog's
names where it has one (``--hf-model-id``, ``--max-batch-size``, ``--no-prefix-cache``,
``--prefill-admission-lookahead``...), so its command lines run unchanged. Its CUDA switches are
real settings: ``--cuda-graph`` replays CUDA graphs for decode steps (without it the benchmarks
run eagerly, as the blog's did), ``--paged-attn`` picks the Triton paged-attention backend on CUDA
(attention is always paged here; on a CPU it changes nothing), ``--nvtx`` marks each run with an
NVTX range.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from roseinfer.config import EngineConfig
from roseinfer.platforms import platform_for, resolve_device
from roseinfer.engine_args import add_engine_args, engine_config_from_args
from roseinfer.sampling_params import SamplingParams

BLOG_NAMES = {
    "model": ("--hf-model-id", "--model"),
    "max_num_seqs": ("--max-batch-size", "--max-num-seqs"),
    "pack_lookahead": ("--prefill-admission-lookahead",),
    "pack_fifo_every": ("--prefill-force-fifo-every",),
}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's flags (the blog's names where it has them) and the blog's CUDA switches."""
    add_engine_args(parser, skip=("seed", "enforce_eager"), names=BLOG_NAMES)
    g = parser.add_argument_group("the blog's switches")
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help="disable prefix caching (the blog's name for --no-enable-prefix-caching)")
    g.add_argument("--paged-attn", action="store_true",
                   help="CUDA: the Triton paged-attention backend (auto picks it too); attention is always paged")
    g.add_argument("--cuda-graph", action="store_true",
                   help="CUDA: replay CUDA graphs for decode steps (without it the benchmark runs eagerly)")
    g.add_argument("--nvtx", action="store_true", help="mark each benchmark run with an NVTX range (CUDA only)")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per request (default: 64)")
    g.add_argument("--no-stop-on-eos", action="store_true",
                   help="keep generating past EOS, so every request makes exactly --max-new-tokens")
    g.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature; 0 = greedy (default: 0, or 1.0 with --do-sample)")
    g.add_argument("--do-sample", action="store_true",
                   help="sample instead of greedy decoding, at --temperature (1.0 unless given), as in the blog")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off (default)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds sampling, prompts and poisson arrivals (default: %(default)s)")


def engine_config_from_flags(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The engine these flags ask for; `args.device` becomes the device `auto` means here."""
    args.device = resolve_device(args.device)
    if args.paged_attn and args.device == "cuda":
        overrides.setdefault("attention_backend", "triton")
    return engine_config_from_args(args, seed=args.seed, enforce_eager=not args.cuda_graph, **overrides)


def sampling_params_from_flags(args: argparse.Namespace) -> SamplingParams:
    # The blog samples only with --do-sample, at its default temperature 1.0; an explicit
    # --temperature keeps its meaning here (0 greedy, above 0 sampling).
    temperature = args.temperature if args.temperature is not None else (1.0 if args.do_sample else 0.0)
    if args.do_sample and temperature == 0.0:
        raise ValueError("--do-sample samples: give it a --temperature above 0 (or leave it out for 1.0)")
    # No per-request seed: one shared seed would make every request sample alike. --seed
    # seeds the engine's sampling generator instead (EngineConfig.seed), which keeps a
    # whole run reproducible.
    return SamplingParams(max_tokens=args.max_new_tokens, temperature=temperature, top_p=args.top_p,
                          top_k=args.top_k, ignore_eos=args.no_stop_on_eos)


@contextlib.contextmanager
def nvtx_range(args: argparse.Namespace, name: str) -> Iterator[None]:
    """An NVTX range around one run when --nvtx is given on CUDA (for nsys); else nothing."""
    if not args.nvtx:
        yield
        return
    import torch

    with platform_for(torch.device(args.device)).trace_range(name):
        yield
