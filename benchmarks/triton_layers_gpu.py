"""The Triton backend's hybrid and MoE layers on a GPU, against the torch paths they replace, alternating
in one process (CUDA events, median of --repeats):
  - the gated delta rule at Qwen3.5's linear-layer shape (32 value heads of 128 x 128, a float32 state
    pool): decode at batch 1, 16 and 64, and the prefill of --prefill-batch sequences of --prefill-len
    tokens; torch = AttentionMetadata's gather / recurrent_step or chunked_prefill / scatter,
    triton = backends/triton/delta_rule.py on the pool in place;
  - one MoE layer's routed experts at Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, width
    768, --dtype): torch = models/moe.py StackedExperts (a matmul pair per routed expert), triton =
    backends/triton/fused_moe.py (two grouped GEMM launches), at --tokens.

    python benchmarks/triton_layers_gpu.py [--repeats 20] [--dtype bfloat16] [--tokens 1,16,64,512]
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from roseinfer.backends.triton import TritonMetadata, fused_moe
from roseinfer.distributed.parallel import SINGLE
from roseinfer.layers.attention import AttentionMetadata
from roseinfer.models.moe import StackedExperts, select_experts

HEADS, DIM = 32, 128
EXPERTS, TOP_K, HIDDEN, WIDTH = 128, 8, 2048, 768


def alternate(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each path's median ms over `repeats` rounds, the paths alternating within a round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for step in paths.values():
        step()  # compiles the Triton kernels
    for _ in range(repeats):
        for name, step in paths.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def delta_rule_inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    shape = (batch, length, HEADS) if length > 1 else (batch, HEADS)
    q, k = (F.normalize(torch.randn(*shape, DIM, device="cuda"), dim=-1) for _ in range(2))
    v = torch.randn(*shape, DIM, device="cuda")
    g, beta = -torch.rand(*shape, device="cuda") * 0.3, torch.rand(*shape, device="cuda")
    pool = torch.zeros(2 * batch, HEADS, DIM, DIM, device="cuda")
    slots, keep = torch.arange(batch, device="cuda") * 2, torch.ones(batch, device="cuda")
    return q * DIM ** -0.5, k, v, g, beta, pool, slots, keep


def bench_delta_rule(repeats: int, prefill_batch: int, prefill_len: int) -> None:
    triton_meta = TritonMetadata(torch.zeros(1, dtype=torch.long, device="cuda"), 16, None, None)
    for batch in (1, 16, 64):
        inputs = delta_rule_inputs(batch, 1)
        ms = alternate({"torch": lambda: AttentionMetadata.delta_rule_decode(None, *inputs),
                        "triton": lambda: triton_meta.delta_rule_decode(*inputs)}, repeats)
        print(f"delta rule decode, batch {batch}: torch {ms['torch']:.3f} ms, triton {ms['triton']:.3f} ms")
    inputs = delta_rule_inputs(prefill_batch, prefill_len) + (torch.full((prefill_batch,), prefill_len,
                                                                          device="cuda"),)
    ms = alternate({"torch": lambda: AttentionMetadata.delta_rule_prefill(None, *inputs),
                    "triton": lambda: triton_meta.delta_rule_prefill(*inputs)}, repeats)
    print(f"delta rule prefill, {prefill_batch} x {prefill_len}: torch {ms['torch']:.3f} ms, "
          f"triton {ms['triton']:.3f} ms")


def bench_moe(repeats: int, dtype: torch.dtype, token_counts: list[int]) -> None:
    experts = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE).to("cuda", dtype)
    for p in experts.parameters():
        p.data.normal_(0, 0.02)
    fused = StackedExperts(EXPERTS, HIDDEN, WIDTH, "silu", SINGLE).to("cuda", dtype)
    fused.load_state_dict(experts.state_dict())
    fused_moe.install(fused)
    router = torch.randn(HIDDEN, EXPERTS, device="cuda", dtype=dtype) * 0.05
    for tokens in token_counts:
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
        weights, ids = select_experts(x @ router, TOP_K, renormalize=True)
        with torch.inference_mode():
            ms = alternate({"torch": lambda: experts.forward(x, weights, ids),
                            "triton": lambda: fused.forward(x, weights, ids)}, repeats)
        print(f"MoE experts, {tokens} tokens: torch {ms['torch']:.3f} ms, triton {ms['triton']:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", default="1,16,64,512")
    parser.add_argument("--prefill-batch", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=512)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    with torch.inference_mode():
        bench_delta_rule(args.repeats, args.prefill_batch, args.prefill_len)
    bench_moe(args.repeats, getattr(torch, args.dtype), [int(t) for t in args.tokens.split(",")])


if __name__ == "__main__":
    main()
