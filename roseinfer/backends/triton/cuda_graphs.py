"""Decode steps replayed from CUDA graphs, as nano-vllm and mini-sglang do: one graph per bucketed
batch size (1, 2, 4, 8, then every 16 up to max_num_seqs), captured at start-up and never on the
serving path; a step's batch is padded to the next bucket. Padding rows write nothing (slot -1)
and attend to nothing (context 0). A decode step launches hundreds of small kernels, and a replay
launches them all at once."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from roseinfer.backends.base import BatchLayout
from roseinfer.layers.attention import KVCache

if TYPE_CHECKING:
    from roseinfer.backends.triton import TritonBackend


def bucket_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, backend: TritonBackend, model: nn.Module, kv_caches: list[KVCache], max_num_seqs: int,
                 max_blocks: int, block_size: int) -> None:
        from roseinfer.backends.triton import DecodeBatch, TritonMetadata

        self.backend = backend
        self.buckets = bucket_sizes(max_num_seqs)
        device, rows = backend.device, self.buckets[-1]
        # the graphs' inputs, which every replay refills: one row per sequence
        self.head = torch.zeros(4, rows, dtype=torch.long, device=device)  # input id, position, slot, context
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.long, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        with torch.inference_mode():
            for batch in reversed(self.buckets):  # the largest first: smaller ones fit in its memory pool
                ids, positions, slots, kv_lens = self.head[:, :batch]
                meta = TritonMetadata(slots, block_size, DecodeBatch(None, self.block_tables[:batch], kv_lens), None,
                                      backend.mlp_chunk_rows)
                slots.fill_(-1)
                model(ids, positions, kv_caches, meta)  # compiles the Triton kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = model(ids, positions, kv_caches, meta)
                pool = graph.pool()
                self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize(device)

    def takes(self, layout: BatchLayout) -> bool:
        """Every row decodes, and a bucket holds them."""
        return len(layout.q_lens) <= self.buckets[-1] and all(n == 1 for n in layout.q_lens)

    def replay(self, layout: BatchLayout) -> torch.Tensor:
        """The step's hidden states [n, hidden]; valid until the next replay."""
        n = len(layout.q_lens)
        batch = next(b for b in self.buckets if b >= n)
        pad = batch - n
        head = torch.tensor([layout.input_ids + [0] * pad, layout.positions + [0] * pad,
                             layout.slot_mapping + [-1] * pad, layout.kv_lens + [0] * pad], dtype=torch.long)
        width = max(len(t) for t in layout.block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in layout.block_tables], dtype=torch.long)
        # from pinned memory: a pageable copy would wait for every queued step (async scheduling's overlap)
        self.head[:, :batch].copy_(head.pin_memory(), non_blocking=True)
        self.backend.fill_future(self.head[0], layout)
        self.block_tables[:n, :width].copy_(tables.pin_memory(), non_blocking=True)
        graph, hidden = self.graphs[batch]
        graph.replay()
        return hidden[:n]
