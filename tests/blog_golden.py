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

# The same command line with --paged-attn --cuda-graph (the post on pinned host buffers, "After"),
# NVTX on too, and --max-inflight-requests, whose two lines join the block where the post on
# backpressure prints them.
STREAMING_INFLIGHT = """\
=== warmup 1/1 ===
=== streaming benchmark ===
Model: gpt2
Device: cuda
Pretok: True
Tokenize workers: 0
Stream interval: 8
Paged attention: True
CUDA Graph: True
NVTX: True
Requests: 64
Rejected: 192
Prompt tokens (total): 64
Completion tokens (total): 8192
Submit wall: 1.296431 s
Submit interval/schedule: 20.000 ms / absolute
Submit lag p50/p95/p99: 23.90/55.74/57.10 ms
add_request latency p50/p95/p99: 0.02/0.07/0.08 ms
reject latency p50/p95/p99: 0.00/0.00/0.00 ms
Tokenize p50/p95/p99: 0.00/0.00/0.00 ms
Queue wait (post-tok) p50/p95/p99: 7.43/77.83/78.57 ms
Prefill->first token p50/p95/p99: 4.70/5.01/5.90 ms
TTFT p50/p95/p99: 12.21/82.61/83.27 ms
TPOT p50/p95/p99: 11.77/13.08/13.63 ms/token
ITL p50/p95/p99: 4.02/78.46/80.44 ms
Latency p50/p95/p99: 1509.76/1672.10/1738.46 ms
Throughput (completion,total): 3210.51 tokens/s
"""


def _number(match: re.Match[str]) -> str:
    frac = match.group(1)
    return "N" if frac is None else "N." + "d" * len(frac)


def mask(text: str) -> list[str]:
    """The lines of ``text`` with model, device and every number masked."""
    text = re.sub(r"^(Model|Device): .*$", r"\1: *", text, flags=re.M)
    return re.sub(r"(?<![A-Za-z\d])\d+(?:\.(\d+))?", _number, text).split("\n")
