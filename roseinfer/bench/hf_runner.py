"""The ``--backend hf`` reference for ``bench offline``: transformers' ``generate``.

The same token-id prompts go through ``AutoModelForCausalLM.generate``, greedy, batched
with left padding (so every row's last prompt token sits at the same position and the
first new token comes out of one forward). Token times come from a stopping criterion,
which ``generate`` calls once per step right after appending that step's tokens.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from roseinfer.engine.llm_engine import DTYPES
from roseinfer.platforms import platform_for
from roseinfer.sampling_params import SamplingParams

from .metrics import RequestTiming


def _step_clock():
    """A StoppingCriteria that never stops and records when each step finished.
    Built lazily so that importing this module does not import transformers."""
    from transformers import StoppingCriteria

    class StepClock(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None, **kwargs) -> torch.Tensor:
            platform_for(input_ids.device).synchronize()  # stamp when the token exists, not when queued
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return StepClock()


class HFRunner:
    name = "hf"

    def __init__(self, folder: str | Path, device: str, dtype: str, eos_token_ids: set[int],
                 batch_size: int) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        # "auto" resolves as the engine resolves it, so both backends compute in one dtype.
        resolved = DTYPES[dtype] if dtype != "auto" else platform_for(self.device).default_dtype
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=resolved).to(self.device).eval()
        self.eos_token_ids = sorted(eos_token_ids)
        pad = self.model.generation_config.pad_token_id
        self.pad_id = pad if isinstance(pad, int) else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.batch_size = batch_size

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: each ``generate`` call starts from an empty cache."""

    def run(self, mode: str, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]:
        """``naive`` generates one prompt at a time; ``offline`` and ``online`` are the same
        batched run here (HF has no engine to step), chunked by ``batch_size``."""
        size = 1 if mode == "naive" else self.batch_size
        t0 = time.perf_counter()
        timings: list[RequestTiming] = []
        for i in range(0, len(prompts), size):
            start = time.perf_counter() if mode == "naive" else t0
            timings += self._generate(prompts[i:i + size], params, start)
        return timings

    @torch.inference_mode()
    def _generate(self, prompts: list[list[int]], params: SamplingParams, start: float) -> list[RequestTiming]:
        longest = max(map(len, prompts))
        ids = torch.full((len(prompts), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), longest), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        clock = _step_clock()
        out = self.model.generate(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=False,
            max_new_tokens=params.max_tokens, min_new_tokens=0, pad_token_id=self.pad_id,
            eos_token_id=None if params.ignore_eos else self.eos_token_ids,
            stopping_criteria=[clock])
        new = out[:, longest:].tolist()
        timings = []
        for row in new:
            n = len(row)
            if not params.ignore_eos:
                # a row that hit EOS is padded afterwards; its count ends at the EOS
                n = next((j + 1 for j, tok in enumerate(row) if tok in self.eos_token_ids), n)
            stamps = clock.times[:n]
            timings.append(RequestTiming(start, start, token_times=stamps, end=stamps[-1] if stamps else None))
        return timings
