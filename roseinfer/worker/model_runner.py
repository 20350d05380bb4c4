"""Owns the model and the KV pool; turns a scheduled step into a flat batch, one forward, and tokens.
What depends on the hardware (attention metadata, the pool's memory, faster layers) is the backend's
(backends/); nothing here asks which one runs. Under tensor parallelism every rank has a runner over
its share of the model and its own pool; rank 0's `prepare`s each step, which the executor hands to
the others, and `run`s it (forward and sampling); theirs only `follow`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from roseinfer.backends.base import Backend, BatchLayout, FutureTokens
from roseinfer.engine.request import PLACEHOLDER, TokenLogprobs
from roseinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from roseinfer.engine.speculative import accept_draft
from roseinfer.layers.attention import KVCache
from roseinfer.models.config import ModelConfig
from roseinfer.platforms.base import LOGITS_CHUNK_ROWS

if TYPE_CHECKING:
    from roseinfer.engine.sampler import SampledRows, Sampler

PromptLogprobs = list[list[TokenLogprobs]]  # per scheduled request, the prompt logprobs this step took
Pooled = list[torch.Tensor | None]  # per scheduled request, an embedding request's pooled part (engine/pooling.py)
StepResult = tuple[list[list[int]], list[TokenLogprobs | None], PromptLogprobs, Pooled]


@dataclass
class PreparedStep:
    """One step's flat batch and the rows whose logits rank 0 takes, in the order every rank
    computes them: the sampled rows in chunks, then the prompt-logprob pieces."""

    items: list[ScheduledRequest]
    layout: BatchLayout
    owners: list[int]  # each sampled row's index in items
    sample_chunks: list[list[int]]
    prompt_pieces: list[tuple[int, slice, list[int]]]  # (index in items, rows, the tokens they predict)

    @property
    def logit_rows(self) -> list[list[int] | slice]:
        return self.sample_chunks + [rows for _, rows, _ in self.prompt_pieces]


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; collect() reads its tokens."""

    step: PreparedStep
    hidden: torch.Tensor
    samples: list[SampledRows]  # per sample chunk
    generator_states: dict[int, torch.Tensor]  # see ModelRunner.launch

    @property
    def tokens(self) -> torch.Tensor:
        """The sampled ids on the device, one per sampled row (in step.owners' order)."""
        parts = [rows.tokens for rows in self.samples]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def token_index(self) -> dict[str, int]:
        """Each sampling request's row in `tokens` (a step without drafts samples one row each)."""
        return {self.step.items[i].request.request_id: row for row, i in enumerate(self.step.owners)}


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, num_kv_blocks: int, block_size: int,
                 backend: Backend, sampler: Sampler | None, num_state_slots: int = 0, num_draft_slots: int = 0) -> None:
        """model_config: what this rank computes (its heads: the pool's shape); sampler: None on a
        rank that only follows; num_state_slots: a hybrid model's state pool (engine/state_pool.py),
        and num_draft_slots more after them, the scratch its verified drafts' states pass through."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = backend.device
        self.sampler = sampler
        self.vocab_size = model_config.vocab_size  # the logits' width
        self.rotary_shift = model_config.max_position_embeddings  # the rotary table's rows per half
        self.hybrid = bool(model_config.linear_layers)
        self.kv_caches = layer_caches(model_config, backend, num_kv_blocks * block_size,
                                      num_state_slots + num_draft_slots)
        self.state_caches = [self.kv_caches[layer] for layer in model_config.linear_layers]
        self.first_draft_slot = num_state_slots

    def capture(self, max_num_seqs: int, max_model_len: int) -> None:
        """What the backend records for later steps (CUDA graphs of decode steps, where it has them;
        not for hybrid models, whose steps gather state slots that a graph would fix)."""
        if self.hybrid:
            return
        self.backend.capture(self.model, self.kv_caches, max_num_seqs, -(-max_model_len // self.block_size),
                             self.block_size)

    @staticmethod
    def kv_bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return (model_config.kv_cache_planes * model_config.num_kv_layers * block_size * model_config.num_kv_heads
                * model_config.head_dim * dtype.itemsize)

    @staticmethod
    def state_bytes_per_slot(model_config: ModelConfig, dtype: torch.dtype) -> int:
        """A state-pool slot: every linear layer's conv state (model dtype) and recurrent state
        (float32: it sums every token so far); 0 for a model without linear layers."""
        shape = model_config.linear_attention
        if shape is None:
            return 0
        per_layer = (shape.conv_dim * (shape.conv_kernel - 1) * dtype.itemsize
                     + shape.num_v_heads * shape.k_head_dim * shape.v_head_dim * 4)
        return len(model_config.linear_layers) * per_layer

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one forward over the scheduled tokens; returns the new tokens per scheduled request
        (none for a prompt chunk, one for a decode, 1 to K + 1 for a verified draft), the logprobs of a
        single token, the prompt logprobs of the prompt positions this step computed, and embedding
        requests' pooled parts."""
        return self.run(self.prepare(out))

    def prepare(self, out: SchedulerOutput, previous: LaunchedStep | None = None) -> PreparedStep:
        """The step's flat batch and its logit rows, from the scheduler's requests (rank 0's part);
        `previous`: the launched step whose sampled ids this one's placeholders stand for."""
        items = out.scheduled
        layout, sample_rows = self._prepare(items)
        if previous is not None:
            self._take_future(layout, items, previous)
        # a draft's request samples every one of its 1 + K rows
        owners = [i for i, item in enumerate(items) if item.samples for _ in range(1 + len(item.draft))]
        chunk = self.backend.logits_chunk_rows or max(len(owners), 1)
        sample_chunks = [sample_rows[start:start + chunk] for start in range(0, len(owners), chunk)]
        return PreparedStep(items, layout, owners, sample_chunks, self._prompt_pieces(items))

    def run(self, step: PreparedStep) -> StepResult:
        """The forward, the LM head on the sampled rows and sampling (see execute)."""
        return self.collect(self.launch(step))

    @torch.inference_mode()
    def launch(self, step: PreparedStep) -> LaunchedStep:
        """The forward, the LM head and sampling, queued; nothing read back where the device runs ahead."""
        items, owners = step.items, step.owners
        hidden = self.backend.forward(self.model, step.layout, self.kv_caches)
        # a seeded sampled request's generator before its rows' draws: see Sampler.rewind
        states = {i: item.request.generator.get_state() for i, item in enumerate(items) if item.draft
                  and item.request.generator is not None and not item.request.sampling_params.greedy}
        samples = []
        start = 0
        for rows in step.sample_chunks:
            part = owners[start:start + len(rows)]
            start += len(rows)
            logits = self.model.compute_logits(self._rows(hidden, rows))
            samples.append(self.sampler.launch(logits, [items[i].request for i in part]))
        return LaunchedStep(step, hidden, samples, states)

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> StepResult:
        """A launched step's tokens and logprobs on the host (see execute)."""
        step = launched.step
        items, owners = step.items, step.owners
        row_tokens: list[list[int]] = [[] for _ in items]
        logprobs: list[TokenLogprobs | None] = [None] * len(items)
        start = 0
        for rows in launched.samples:
            tokens, lps = self.sampler.read(rows)
            for i, token, lp in zip(owners[start:start + len(tokens)], tokens, lps):
                row_tokens[i].append(token)
                logprobs[i] = lp
            start += len(tokens)
        sampled = [accept_draft(item.draft, row_tokens[i]) if item.draft else row_tokens[i]
                   for i, item in enumerate(items)]
        self._commit_draft_states(step, sampled)
        for i, state in launched.generator_states.items():
            self.sampler.rewind(items[i].request.generator, state, len(sampled[i]), self.vocab_size)
        return (sampled, logprobs, self._prompt_logprobs(items, launched.hidden, step.prompt_pieces),
                self._pooled(step, launched.hidden))

    def _commit_draft_states(self, step: PreparedStep, sampled: list[list[int]]) -> None:
        """A hybrid model's verified drafts: a request's slot holds each linear layer's state after its
        whole draft, the scratch slots the states after each earlier position. Where the target
        rejected a draft token, the state after the last position whose input was kept (the request's
        last token and the draft tokens accepted) replaces the slot's: the state plain decode of the
        emitted tokens leaves, the token sampled after them not yet fed."""
        sources, targets = [], []
        for i, first in step.layout.draft_scratch.items():
            accepted = len(sampled[i]) - 1
            if accepted < len(step.items[i].draft):
                sources.append(first + accepted)
                targets.append(step.items[i].request.state_slot)
        if targets:
            sources_t, targets_t = self.backend.tensor(sources), self.backend.tensor(targets)
            for conv, recurrent in self.state_caches:
                conv[targets_t] = conv[sources_t]
                recurrent[targets_t] = recurrent[sources_t]

    def _take_future(self, layout: BatchLayout, items: list[ScheduledRequest], previous: LaunchedStep) -> None:
        """Each row whose input is a placeholder reads its id from the previous step's tokens on the
        device (a placeholder is only ever a chunk's last input, the token sampled after it)."""
        index = previous.token_index()
        rows, indices = [], []
        for item, end in zip(items, layout.q_starts[1:] + [layout.num_tokens]):
            if layout.input_ids[end - 1] == PLACEHOLDER:
                layout.input_ids[end - 1] = 0
                rows.append(end - 1)
                indices.append(index[item.request.request_id])
        if rows:
            layout.future = FutureTokens(rows, previous.tokens, indices)

    @torch.inference_mode()
    def follow(self, layout: BatchLayout, logit_rows: list[list[int] | slice]) -> None:
        """Another tensor-parallel rank's part in a step that rank 0 runs (`execute`): the same
        forward over its share of the model, then the LM head on the same rows in the same order,
        its slice of their logits going to rank 0 (the executor sends both)."""
        hidden = self.backend.forward(self.model, layout, self.kv_caches)
        for rows in logit_rows:
            self.model.compute_logits(self._rows(hidden, rows))

    def _rows(self, hidden: torch.Tensor, rows: list[int] | slice) -> torch.Tensor:
        return hidden[rows] if isinstance(rows, slice) else hidden[self.backend.tensor(rows)]

    @staticmethod
    def _pooled(step: PreparedStep, hidden: torch.Tensor) -> Pooled:
        """Each embedding request's part of this step, in fp32: its chunk's row sum for mean pooling,
        its last row once its prompt is done for last-token pooling, its first chunk's first row
        for cls pooling (engine/pooling.py adds them up)."""
        parts: Pooled = []
        for item, start in zip(step.items, step.layout.q_starts):
            params = item.request.pooling_params
            pooling = params.pooling if params is not None else None
            if pooling == "mean":
                parts.append(hidden[start:start + item.num_tokens].float().sum(dim=0))
            elif pooling == "last" and item.reaches_end:
                parts.append(hidden[start + item.num_tokens - 1].float())
            elif pooling == "cls" and item.request.num_computed_tokens == 0:
                parts.append(hidden[start].float())
            else:
                parts.append(None)
        return parts

    def _prompt_pieces(self, items: list[ScheduledRequest]) -> list[tuple[int, slice, list[int]]]:
        """For requests with prompt_logprobs, the logits at every prompt position this step computes
        (but the last, which samples) give the next prompt token's logprob; a chunk's last row gives
        the next chunk's first. Returns (the request's index, rows of the flat batch, the tokens they
        predict), LOGITS_CHUNK_ROWS rows a piece on every device: a long prompt's whole logits block
        would be the step's largest allocation, and only the entries are kept."""
        pieces = []
        offset = 0  # the request's first row in the flat batch
        for i, item in enumerate(items):
            req = item.request
            positions = req.prompt_logprob_positions(item.num_tokens)
            first_row = offset + positions.start - req.num_computed_tokens
            for start in range(0, len(positions), LOGITS_CHUNK_ROWS):
                rows = min(LOGITS_CHUNK_ROWS, len(positions) - start)
                targets = req.token_ids[positions.start + start + 1:positions.start + start + rows + 1]
                pieces.append((i, slice(first_row + start, first_row + start + rows), targets))
            offset += item.num_tokens
        return pieces

    def _prompt_logprobs(self, items: list[ScheduledRequest], hidden: torch.Tensor,
                         pieces: list[tuple[int, slice, list[int]]]) -> PromptLogprobs:
        # imported here: a tensor-parallel worker never samples, so it never loads the sampler
        from roseinfer.engine.sampler import token_logprobs

        result: PromptLogprobs = [[] for _ in items]
        for i, rows, targets in pieces:
            logits = self.model.compute_logits(hidden[rows])
            result[i] += token_logprobs(torch.log_softmax(logits, dim=-1), targets,
                                        items[i].request.sampling_params.prompt_logprobs)
        return result

    def _prepare(self, items: list[ScheduledRequest]) -> tuple[BatchLayout, list[int]]:
        """The step's flat batch for the backend, and the rows whose logits are sampled."""
        bs = self.block_size
        layout = BatchLayout(bs, [], [], [], [], [], [], [])
        sample_rows: list[int] = []
        draft_slot = self.first_draft_slot
        for item in items:
            req = item.request
            start, end = req.num_computed_tokens, req.num_computed_tokens + item.num_tokens
            layout.q_starts.append(len(layout.input_ids))
            layout.q_lens.append(item.num_tokens)
            layout.kv_lens.append(end)
            layout.block_tables.append(req.block_table)
            if req.state_slot is not None:
                layout.state_slots.append(req.state_slot)
                if item.draft:
                    layout.draft_scratch[len(layout.q_starts) - 1] = draft_slot
                    draft_slot += len(item.draft)
            layout.input_ids.extend(req.token_ids[start:end])
            layout.input_ids.extend(item.draft)
            # a sequence past LongRoPE's original context reads the table's long half (layers/rotary.py)
            shift = self.rotary_shift if req.kv_rotated_long else 0
            layout.positions.extend(range(start + shift, end + shift))
            table = req.block_table
            layout.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if item.samples:
                sample_rows.extend(range(len(layout.input_ids) - 1 - len(item.draft), len(layout.input_ids)))
        return layout, sample_rows

    @staticmethod
    @torch.inference_mode()
    def profile(model: nn.Module, model_config: ModelConfig, backend: Backend, block_size: int,
                num_tokens: int, num_logits: int) -> None:
        """One forward of the largest step, a prompt of num_tokens into a throwaway pool, and the LM
        head on num_logits rows: its peak memory sizes the real pool (Platform.kv_pool_bytes)."""
        blocks = -(-num_tokens // block_size)
        hybrid = bool(model_config.linear_layers)
        caches = layer_caches(model_config, backend, blocks * block_size, 1 if hybrid else 0)
        tokens = list(range(num_tokens))
        layout = BatchLayout(block_size, [0] * num_tokens, tokens, tokens, [0], [num_tokens], [num_tokens],
                             [list(range(blocks))], [0] if hybrid else [])
        hidden = backend.forward(model, layout, caches)
        model.compute_logits(hidden[-min(num_logits, num_tokens):])


def layer_caches(model_config: ModelConfig, backend: Backend, kv_slots: int, state_slots: int) -> list[KVCache]:
    """Each layer's cache, in layer order: a full-attention layer's (K, V) from the paged pool (one
    tensor for all of them, backend-allocated; where the model keeps one plane, MLA's latent rows
    (ModelConfig.kv_cache_planes), K and V are the same tensor), a linear-attention layer's (conv
    state, recurrent state) with a row per state-pool slot (zeroed once; see engine/state_pool.py)."""
    pool = backend.platform.allocate_kv_pool((model_config.num_kv_layers, model_config.kv_cache_planes, kv_slots,
                                              model_config.num_kv_heads, model_config.head_dim), backend.dtype)
    kv = iter([(pool[i, 0], pool[i, -1]) for i in range(model_config.num_kv_layers)])
    shape = model_config.linear_attention
    caches: list[KVCache] = []
    for layer in range(model_config.num_layers):
        if layer not in model_config.linear_layers:
            caches.append(next(kv))
            continue
        caches.append((torch.zeros(state_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=backend.dtype,
                                   device=backend.device),
                       torch.zeros(state_slots, shape.num_v_heads, shape.k_head_dim, shape.v_head_dim,
                                   dtype=torch.float32, device=backend.device)))
    return caches
