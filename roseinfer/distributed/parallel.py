"""Tensor parallelism as the models see it: this process's rank in the group, which share of each
weight it holds, and the collectives the models call. At size 1 (every engine without
--tensor-parallel-size) each collective returns its input and torch.distributed is never touched.

Megatron-LM's split: q/k/v and gate/up are column-parallel (each rank computes its own heads and its
own slice of the MLP's width), o and down row-parallel (each rank's partial sums, added by one
all-reduce), the embedding and the LM head vocabulary-parallel (a rank holds a slice of the rows; the
lookup is masked and all-reduced, the logits gathered to rank 0). Attention heads are split by KV
head, so a rank's query heads and the KV heads they read live together; with fewer KV heads than
ranks each KV head is held by the ranks whose query heads read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from roseinfer.layers.linear import Linear


@dataclass(frozen=True)
class Part:
    """One sub-projection of a column-parallel weight (q, k or v of a fused qkv; gate or up; the
    whole weight of an unfused one; a vocabulary), split on its rows: `size` rows in the checkpoint,
    of which this rank holds `rows` from `start` on (where a vocabulary does not divide evenly, the
    last rank's slice runs past the checkpoint's rows: that room is zeros)."""

    size: int
    start: int
    rows: int


class TensorParallel:
    """One process's rank in a tensor-parallel group, and the group's collectives (`group` is a
    torch.distributed process group: gloo on CPU, NCCL on CUDA; None at size 1)."""

    def __init__(self, rank: int = 0, size: int = 1, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None) -> None:
        self.rank, self.size, self.group = rank, size, group
        self.device = device or torch.device("cpu")  # where the group's tensors live

    def leave(self) -> None:
        """Shut the group down and drop it (the one reference the models' layers share), so that its
        threads end now. A group left alive until interpreter exit can abort the process there
        (pytorch/pytorch#190489); no collective runs afterwards."""
        group, self.group = self.group, None
        if group is not None:
            group.shutdown()

    # ---- shares of a weight --------------------------------------------------------------
    def even(self, total: int) -> Part:
        """This rank's slice of `total` rows (heads, the MLP's width); check_tensor_parallel
        (worker/sharding.py) has checked that it divides."""
        rows = total // self.size
        return Part(total, self.rank * rows, rows)

    def kv_heads(self, num_kv_heads: int, head_dim: int) -> Part:
        """The rows of this rank's KV heads: its slice of them, or, with fewer KV heads than ranks,
        the one head its query heads read (held by size / num_kv_heads ranks)."""
        heads = max(1, num_kv_heads // self.size)
        first = self.rank * num_kv_heads // self.size
        return Part(num_kv_heads * head_dim, first * head_dim, heads * head_dim)

    def vocab(self, vocab_size: int) -> Part:
        """This rank's rows of the embedding table and the LM head: ceil(V / size) each."""
        rows = -(-vocab_size // self.size)
        return Part(vocab_size, self.rank * rows, rows)

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place (a row-parallel layer's partial outputs)."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def min(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks every rank's memory allows)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())

    def embed(self, embedding: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """A vocabulary-parallel lookup: each rank looks up the ids in its slice of the table (zeros
        for the others), and the all-reduce puts each row together from the rank that has it."""
        if self.size == 1:
            return embedding.forward(input_ids)
        part = embedding.tp_parts[0]
        local = input_ids - part.start
        outside = (local < 0) | (local >= part.rows)
        x = embedding.forward(local.masked_fill(outside, 0))
        x[outside] = 0
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The LM head's output [rows, V / size] from every rank, side by side on rank 0 and cut to
        the vocabulary ([rows, V]); None on the other ranks."""
        if self.size == 1:
            return logits
        logits = logits.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [logits], opts).wait()
            return None
        pieces = [torch.empty_like(logits) for _ in range(self.size)]
        self.group.gather([pieces], [logits], opts).wait()
        whole = torch.cat(pieces, dim=-1)
        return whole if whole.shape[-1] == vocab_size else whole[:, :vocab_size].contiguous()


SINGLE = TensorParallel()  # no parallelism: every engine without --tensor-parallel-size


# ---- the layers, as the models build them (their weight loaders take their share: models/weights.py)
def column_parallel(in_features: int, parts: list[Part], bias: bool) -> Linear:
    """A Linear holding this rank's rows of each sub-projection in `parts`, side by side (its qkv:
    its q heads, its k heads, its v heads). At size 1 the parts are whole: a fused projection."""
    layer = Linear(in_features, sum(part.rows for part in parts), bias=bias)
    layer.tp_parts = parts
    return layer


def row_parallel(in_features: int, out_features: int, tp: TensorParallel, bias: bool) -> Linear:
    """A Linear holding this rank's columns: its output is a partial sum, completed by the caller's
    all-reduce. Only rank 0 has the bias, so the sum adds it once."""
    part = tp.even(in_features)
    layer = Linear(part.rows, out_features, bias=bias and tp.rank == 0)
    layer.tp_input = part
    return layer


def vocab_parallel_embedding(vocab_size: int, hidden_size: int, tp: TensorParallel) -> nn.Embedding:
    """An embedding table holding this rank's rows of the vocabulary (look up through tp.embed)."""
    part = tp.vocab(vocab_size)
    # no random values, as Linear: the checkpoint sets the table
    embedding = nn.Embedding.from_pretrained(torch.empty(part.rows, hidden_size), freeze=False)
    embedding.tp_parts = [part]
    return embedding
