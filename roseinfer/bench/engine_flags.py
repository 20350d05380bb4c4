"""Engine and sampling flags shared by ``bench streaming`` and ``bench offline``.

The names are the roseinfer blog's (``--hf-model-id``, ``--max-batch-size``,
``--no-prefix-cache``, ``--no-stop-on-eos``...), so its command lines run unchanged; each
is mapped explicitly onto an EngineConfig field here, in one place, instead of through
``add_engine_args`` whose vLLM names would clash with them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from roseinfer.config import ADMISSION_POLICIES, EngineConfig
from roseinfer.engine_args import HELP
from roseinfer.sampling_params import SamplingParams


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Model, device and scheduler flags (the blog's names)."""
    g = parser.add_argument_group("engine")
    g.add_argument("--hf-model-id", "--model", dest="model", default=None, metavar="MODEL",
                   help="HF folder, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    g.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"),
                   help="auto (default) = bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--max-batch-size", type=int, default=256,
                   help="most sequences in one step, max_num_seqs (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in blocks (default: sized from memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    g.add_argument("--no-prepack-weights", action="store_true", help=HELP["prepack_weights"])
    g.add_argument("--no-native-kernels", action="store_true", help=HELP["native_kernels"])
    g.add_argument("--prefill-max-batch-size", type=int, default=None, help="most new requests admitted per step")
    g.add_argument("--prefill-max-tokens", type=int, default=None, help="most prompt tokens computed per step")
    g.add_argument("--prefill-admission-policy", choices=ADMISSION_POLICIES, default="fifo",
                   help="fifo (default), or pack: smallest prompts first within a lookahead window")
    g.add_argument("--prefill-admission-lookahead", type=int, default=EngineConfig.pack_lookahead,
                   help=HELP["pack_lookahead"] + " (default: %(default)s)")
    g.add_argument("--prefill-force-fifo-every", type=int, default=EngineConfig.pack_fifo_every,
                   help=HELP["pack_fifo_every"] + " (default: %(default)s; the engine keeps this guard, "
                                                  "so the blog's 0 = never is refused)")
    g.add_argument("--max-active-requests", type=int, default=None, help="most admitted (running) requests at once")
    g.add_argument("--decode-first", action="store_true",
                   help="alternate decode-only and prefill-only steps instead of mixing them")
    # The blog's CUDA switches. Attention is always paged here and the engine has no CUDA
    # graphs yet; the flags are accepted so the blog's command lines parse everywhere.
    g.add_argument("--paged-attn", action="store_true", help="accepted for the blog's command lines: always on")
    g.add_argument("--cuda-graph", action="store_true",
                   help="accepted for the blog's command lines; the engine has no CUDA graphs yet")
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
    if args.cuda_graph and args.device.startswith("cuda"):
        print("note: --cuda-graph is accepted but the engine has no CUDA graphs yet; running eagerly",
              file=sys.stderr)
    values = dict(
        model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
        max_model_len=args.max_model_len, num_threads=args.num_threads,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_cache, prepack_weights=not args.no_prepack_weights,
        native_kernels=not args.no_native_kernels,
        max_num_seqs=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_max_batch_size=args.prefill_max_batch_size, prefill_max_tokens=args.prefill_max_tokens,
        prefill_admission_policy=args.prefill_admission_policy,
        pack_lookahead=args.prefill_admission_lookahead, pack_fifo_every=args.prefill_force_fifo_every,
        decode_first=args.decode_first, max_active_requests=args.max_active_requests,
    )
    values.update(overrides)
    return EngineConfig(**values)


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
    if not (args.nvtx and args.device.startswith("cuda")):
        yield
        return
    import torch

    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()
