"""Speculative decoding with a draft model: a smaller model sharing the target's vocabulary proposes
K tokens by its argmax, and the target verifies them as it verifies n-gram drafts.

The draft keeps no per-request state between proposals: each proposal copies the request's tokens
into a throwaway request in the draft's own KV pool and block manager, computes what the pool's
prefix cache does not hold, decodes K - 1 more tokens one forward at a time, and frees it. Its full
blocks stay indexed, so the next proposal recomputes only the tail since the last full block plus
the tokens accepted since (under a block_size + K tokens); preemption and abort of the target
request need nothing here. All of a step's proposals share each draft forward: K forwards a step.
"""
from __future__ import annotations

import torch

from roseinfer.config import EngineConfig, SpeculativeConfig
from roseinfer.engine.block_manager import BlockManager, blocks_for
from roseinfer.engine.request import Request
from roseinfer.engine.scheduler import ScheduledRequest, SchedulerOutput
from roseinfer.engine.speculative import Proposer
from roseinfer.loader.model_loader import resolve_model_folder
from roseinfer.models.config import ModelConfig
from roseinfer.sampling_params import SamplingParams
from roseinfer.worker.worker import Worker, WorkerSpec

ARGMAX = SamplingParams(temperature=0.0)


class DraftModelProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, engine_config: EngineConfig, target: ModelConfig,
                 max_model_len: int, device: torch.device, dtype: torch.dtype) -> None:
        # the draft is whole on one rank, and reads its GGUF blocks (if any) dequantized, as resolved here
        self.worker = Worker(WorkerSpec(engine_config, resolve_model_folder(config.model),
                                        engine_config.attention_backend, dtype, max_model_len, "auto"), device)
        draft = self.worker.model_config
        if draft.linear_layers:
            raise ValueError(f"speculative_config: the draft model ({draft.model_type}) has linear-attention layers, "
                             "whose per-request state a proposal, which keeps none between steps, cannot carry; "
                             "use a draft without them or n-gram speculation")
        vocab = draft.vocab_size
        if vocab != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({vocab} tokens) "
                             f"differs from the target's ({target.vocab_size}); a draft must share its tokenizer")
        super().__init__(config, min(max_model_len, self.worker.model_config.max_position_embeddings))
        self.worker.load_model()
        bs = engine_config.block_size
        # a full-length context for each request that may speculate at once, so that their proposals
        # fit together and do not evict each other's cached blocks
        num_blocks = (config.disable_by_batch_size + 1) * blocks_for(self.max_model_len, bs)
        self.block_manager = BlockManager(num_blocks, bs, enable_prefix_caching=True)
        self.worker.init_kv_cache(num_blocks, eos_token_ids=set())
        self.chunk_tokens = engine_config.max_num_batched_tokens  # the draft's prefill chunk

    def draft(self, asked: list[tuple[Request, int]]) -> list[list[int]]:
        bm = self.block_manager
        shadows: list[tuple[Request, int, int]] = []  # each with where its draft starts and ends
        for req, k in asked:
            shadow = Request(req.request_id, list(req.token_ids), ARGMAX)
            shadow.num_computed_tokens = bm.allocate_cached_prefix(shadow)
            # the last draft token's K/V is never needed
            if bm.append_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k - 1):
                shadows.append((shadow, req.num_tokens, req.num_tokens + k))
            else:
                bm.free(shadow)  # the draft pool is full of other proposals: no draft this step
        active = [(shadow, end) for shadow, _, end in shadows]
        while active:
            # one forward for every shadow: prompt tails in chunks under the token budget, then decodes
            budget = self.chunk_tokens
            step = SchedulerOutput()
            for shadow, _ in active:
                n = min(shadow.num_tokens - shadow.num_computed_tokens, budget)
                if n > 0:
                    step.scheduled.append(ScheduledRequest(shadow, n))
                    budget -= n
            sampled, *_ = self.worker.execute(step)
            for item, tokens in zip(step.scheduled, sampled):
                item.request.num_computed_tokens += item.num_tokens
                item.request.token_ids += tokens  # empty for a prompt chunk that is not the last
            active = [(shadow, end) for shadow, end in active if shadow.num_tokens < end]
        drafts = {shadow.request_id: shadow.token_ids[start:] for shadow, start, _ in shadows}
        for shadow, _, _ in shadows:
            bm.cache_full_blocks(shadow)
            bm.free(shadow)
        return [drafts.get(req.request_id, []) for req, _ in asked]
