"""Owns the model and the KV pool; turns a scheduled step into tensors, one forward, and tokens."""
from __future__ import annotations

import math
import mmap

import torch
from torch import nn

from roseinfer.engine.request import TokenLogprobs
from roseinfer.engine.sampler import Sampler, token_logprobs
from roseinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from roseinfer.layers.attention import AttentionGroup, AttentionMetadata
from roseinfer.layers.native import prefill_attention_supported
from roseinfer.models.config import ModelConfig


LOGITS_CHUNK_ROWS = 64  # rows of logits per LM-head pass on CPU, and for prompt logprobs anywhere (see execute)
PromptLogprobs = list[list[TokenLogprobs]]  # per scheduled request, the prompt logprobs this step took


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, num_kv_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, sampler: Sampler, native: bool = False) -> None:
        self.model = model
        self.native = native  # C kernels for the KV writes and attention (layers/native.py)
        self.native_prefill = native and prefill_attention_supported(
            model_config.head_dim, model_config.num_heads // model_config.num_kv_heads)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.sampler = sampler
        shape = (model_config.num_layers, 2, num_kv_blocks * block_size, model_config.num_kv_heads,
                 model_config.head_dim)
        pool = _zeroed_pool(shape, dtype, device)
        self.kv_caches = [(pool[layer, 0], pool[layer, 1]) for layer in range(model_config.num_layers)]

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * dtype.itemsize

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int | None], list[TokenLogprobs | None], PromptLogprobs]:
        """Run one forward over the scheduled tokens; returns a token (or None) per scheduled request,
        its logprobs, and the prompt logprobs of the prompt positions this step computed."""
        items = out.scheduled
        input_ids, positions, meta, sample_rows = self._prepare(items)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        sampled: list[int | None] = [None] * len(items)
        logprobs: list[TokenLogprobs | None] = [None] * len(items)
        sampling = [i for i, item in enumerate(items) if item.samples]
        # On CPU the logits are computed and sampled LOGITS_CHUNK_ROWS rows at a time: at batch 256
        # the whole [256, 49152] block is a 50 MB transient that sets the process's peak. At 64 rows
        # the LM head stays as fast (batch 256, steps alternated in one engine: 88.1 against 89.3 ms
        # of head and sampling a step). CUDA keeps one pass: its allocator reuses blocks, and each
        # piece would cost a host sync.
        chunk = LOGITS_CHUNK_ROWS if self.device.type == "cpu" else max(len(sampling), 1)
        for start in range(0, len(sampling), chunk):
            part = sampling[start:start + chunk]
            logits = self.model.compute_logits(hidden[sample_rows[start:start + chunk]])
            tokens, lps = self.sampler(logits, [items[i].request for i in part])
            for i, token, lp in zip(part, tokens, lps):
                sampled[i], logprobs[i] = token, lp
        return sampled, logprobs, self._prompt_logprobs(items, hidden)

    def _prompt_logprobs(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> PromptLogprobs:
        """For requests with prompt_logprobs, the logits at every prompt position this step computes
        (but the last, which samples) give the next prompt token's logprob; a chunk's last row gives
        the next chunk's first. LOGITS_CHUNK_ROWS rows at a time on every device: a long prompt's
        whole logits block would be the step's largest allocation, and only the entries are kept."""
        result: PromptLogprobs = [[] for _ in items]
        offset = 0  # the request's first row in the flat batch
        for i, item in enumerate(items):
            req = item.request
            positions = req.prompt_logprob_positions(item.num_tokens)
            first_row = offset + positions.start - req.num_computed_tokens
            for start in range(0, len(positions), LOGITS_CHUNK_ROWS):
                rows = min(LOGITS_CHUNK_ROWS, len(positions) - start)
                logits = self.model.compute_logits(hidden[first_row + start:first_row + start + rows])
                targets = req.token_ids[positions.start + start + 1:positions.start + start + rows + 1]
                result[i] += token_logprobs(torch.log_softmax(logits, dim=-1), targets,
                                            req.sampling_params.prompt_logprobs)
            offset += item.num_tokens
        return result

    def _prepare(self, items: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets: list[int] = []
        sample_rows: list[int] = []
        bs = self.block_size
        for item in items:
            req = item.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + item.num_tokens
            offsets.append(len(input_ids))
            input_ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        decode = [i for i, item in enumerate(items) if item.num_tokens == 1]
        prefill = [i for i, item in enumerate(items) if item.num_tokens > 1]
        groups = [self._group(items, offsets, idx) for idx in (decode, prefill) if idx]
        if len(groups) == 1 and groups[0].is_decode:
            groups[0].whole_batch = True  # every row decodes, in order: no query gather or scatter
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), groups=groups, native=self.native,
                                 fused_decode=groups[0].whole_batch and groups[0].kv_lens is not None)
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(sample_rows)

    def _group(self, items: list[ScheduledRequest], offsets: list[int], idx: list[int]) -> AttentionGroup:
        q_lens = self._tensor([items[i].num_tokens for i in idx])
        starts = self._tensor([offsets[i] for i in idx])
        max_q = int(q_lens.max())
        if max_q > 1 and self.native_prefill:
            # the C kernel reads each chunk's rows in place: no padding, gather or mask to build
            group = AttentionGroup(block_size=self.block_size, q_starts=starts, q_lens=q_lens)
            group.kv_lens, _ = self._set_block_tables(group, items, idx)
            return group
        q_pos = torch.arange(max_q, device=self.device).unsqueeze(0)  # [1, Lq]
        valid = q_pos < q_lens.unsqueeze(1)
        query_rows = starts.unsqueeze(1) + torch.minimum(q_pos, q_lens.unsqueeze(1) - 1)
        valid_slots = valid.flatten().nonzero().squeeze(1)
        group = AttentionGroup(query_rows=query_rows, valid_slots=valid_slots,
                               output_rows=query_rows.flatten().index_select(0, valid_slots), block_size=self.block_size)
        if max_q > 1 and all(items[i].request.num_computed_tokens == 0 for i in idx):
            group.fresh = True  # whole prompts: attention needs neither the cache nor a mask
            return group
        ctx_lens, max_blocks = self._set_block_tables(group, items, idx)
        if max_q == 1 and self.native:
            group.kv_lens = ctx_lens  # the kernel stops at each length: no mask
            return group
        # absolute position of each query; key j is visible when j <= that position (and j < ctx)
        abs_pos = (ctx_lens - q_lens).unsqueeze(1) + q_pos  # [B, Lq]
        keys = torch.arange(max_blocks * self.block_size, device=self.device)
        visible = (keys.view(1, 1, -1) <= abs_pos.unsqueeze(2)) & (keys.view(1, 1, -1) < ctx_lens.view(-1, 1, 1))
        # additive float mask: SDPA would otherwise convert a bool mask in every layer
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        group.mask = mask.unsqueeze(1)
        return group

    def _set_block_tables(self, group: AttentionGroup, items: list[ScheduledRequest],
                          idx: list[int]) -> tuple[torch.Tensor, int]:
        """Sets the group's block tables (padded with block 0); returns each sequence's context
        length (this step's tokens included) and the table width."""
        ctx_lens = self._tensor([items[i].request.num_computed_tokens + items[i].num_tokens for i in idx])
        max_blocks = -(-int(ctx_lens.max()) // self.block_size)
        tables = [items[i].request.block_table[:max_blocks] for i in idx]
        group.block_tables = self._tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        return ctx_lens, max_blocks

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV pool, allocated once and zeroed: padded and masked key slots still enter the attention
    matmuls, and a NaN bit pattern there would survive a zero weight.

    On CPU, a private anonymous mmap in 2 MB pages where the kernel allows (transparent huge pages,
    "madvise" mode): decode attention reads K/V blocks scattered over the whole pool, and with 4 KB
    pages their address translations miss the TLB and push out the matmuls' own. A paired run (two
    engines in one process, steps alternated) took 146 against 152 ms a step at batch 64 and 51.2
    against 53.0 at 16.

    Every page is written once here, so the pool is resident before the first request, as vLLM's
    and llama.cpp's are. Left to first touch, the faults landed in serving: with prefix caching, a
    freed full block stays cached and the next request gets a never-touched one, so every request
    paid them until the whole pool had been used once (on a KVM guest ~4 ms per 2 MB page: ~30 ms
    more at each block boundary at batch 16, and a 64 x (32 in / 64 out) run took 10.0-10.1 against
    11.2-11.5 s once written up front, measured on this machine). The memory is also committed when
    the pool is sized: a pool too large for the machine shows at startup, not in the middle of serving."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffer = mmap.mmap(-1, numel * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only
        buffer.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # the tensor keeps the mapping alive
    return pool.zero_()  # already zeros: the write commits every page now, on torch's threads
