"""Structured output in the engine: constrained requests' outputs always satisfy their constraint
(a tiny random-weight model writes noise, so only the mask makes them valid), free neighbours are
untouched, and scheduling (preemption, chunked prefill, prefix caching, n > 1) keeps working."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from roseinfer import LLM, SamplingParams, StructuredOutputsParams
from tiny_models import hf_greedy, sample_prompts

MAX_TOKENS = 200  # the tiny models hold 256 positions
# bounded strings, numbers and arrays, so that noise finishes well inside MAX_TOKENS
SCHEMAS = {
    "nested object, optional field": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6},
                       "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                                                    "city": {"type": "string", "maxLength": 4}},
                                   "required": ["zip"], "additionalProperties": False},
                       "nickname": {"type": "string", "maxLength": 3}},
        "required": ["name", "address"], "additionalProperties": False},
    "array with min/max items of enums": {
        "type": "array", "items": {"enum": ["red", "green", 7, None]}, "minItems": 2, "maxItems": 4},
    "bounded numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "integer", "minimum": -5, "maximum": 5},
                       "ok": {"type": "boolean"}},
        "required": ["age", "score", "ok"], "additionalProperties": False},
    "$ref / $defs": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                             "y": {"type": "integer", "minimum": 0, "maximum": 9}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False},
    "string pattern and anyOf": {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"const": "none"}]}},
        "required": ["id", "v"], "additionalProperties": False},
}
REGEX = r"[A-Z][a-z]{1,6} (19|20)[0-9]{2}"
CHOICES = ["yes", "no", 'say "maybe"\nlater']
GRAMMAR = 'start: "(" num ("+" num){0,3} ")"\nnum: /[0-9]{1,3}/'
GRAMMAR_RE = r"\([0-9]{1,3}(\+[0-9]{1,3}){0,3}\)"


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=128)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    return sample_prompts(model_dir, 6, seed=5, max_len=40)


@pytest.fixture(scope="module", autouse=True)
def close_bias(llm: LLM) -> None:
    """Any JSON object admits keys of any length, which noise would never close: a bias towards the
    closing characters shortens them (the mask alone still decides what is valid)."""
    CLOSE_BIAS.update({llm.tokenizer.token_to_id(c): 4.0 for c in '"}'})


CLOSE_BIAS: dict[int, float] = {}


def constrained(seed: int | None = None, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS,
                          logit_bias=CLOSE_BIAS if "json_object" in constraint else None,
                          structured_outputs=StructuredOutputsParams(**constraint))


def check(text: str, **constraint) -> None:
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "json_object" in constraint:
        assert isinstance(json.loads(text), dict)
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    elif "choice" in constraint:
        assert text in constraint["choice"]
    else:
        assert re.fullmatch(GRAMMAR_RE, text), text


CONSTRAINTS = [{"json": s} for s in SCHEMAS.values()] + [
    {"json_object": True}, {"regex": REGEX}, {"choice": CHOICES}, {"grammar": GRAMMAR}]
IDS = list(SCHEMAS) + ["json_object", "regex", "choice", "lark grammar"]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=IDS)
def test_every_constrained_output_satisfies_its_constraint(llm, prompts, constraint) -> None:
    params = [constrained(**constraint)] + [constrained(seed=s, temperature=1.0, **constraint) for s in range(5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop", (out.text, out.finish_reason)
        check(out.text, **constraint)
    assert len({o.text for o in outs}) > 1 or "choice" in constraint, "the mask should leave the noise some room"
    assert llm.kv_cache_stats()["used_blocks"] == 0


def test_free_requests_match_hf_beside_constrained_ones(llm, model_dir, prompts) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [free, constrained(json=SCHEMAS["bounded numbers"]), free, constrained(regex=REGEX, seed=3, temperature=1.0),
              free, constrained(choice=CHOICES)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 2, 4):
        assert outs[i].token_ids == hf_greedy(model_dir, prompts[i], 12)


def test_eos_only_where_the_grammar_may_end(llm, prompts) -> None:
    """With EOS pushed to the top of every row, the output still runs to a complete constrained value
    (the mask holds EOS back until then) and stops there."""
    eos = sorted(llm.tokenizer.eos_token_ids)
    for constraint in ({"choice": CHOICES}, {"json": SCHEMAS["bounded numbers"]}, {"regex": REGEX}):
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logit_bias={t: 100.0 for t in eos},
                                structured_outputs=StructuredOutputsParams(**constraint))
        out = llm.generate(prompts[0], params, use_tqdm=False)[0]
        assert out.finish_reason == "stop"
        check(out.text, **constraint)


def test_scheduling_modes_leave_constrained_outputs_unchanged(model_dir, prompts) -> None:
    """Preemption (recompute), a tiny token budget (chunked prefill) and prefix caching give the same
    seeded outputs as a roomy engine."""
    shared = prompts[0][:24]
    batch = [shared + p[:8] for p in prompts]
    params = [constrained(seed=i, temperature=1.0, **c) for i, c in
              enumerate([{"json": SCHEMAS["$ref / $defs"]}, {"regex": REGEX}, {"json": SCHEMAS["nested object, optional field"]},
                         {"grammar": GRAMMAR}, {"json_object": True}, {"choice": CHOICES}])]
    reference = [o.text for o in LLM(str(model_dir), num_kv_blocks=128).generate(batch, params, use_tqdm=False)]
    for options in ({"num_kv_blocks": 16}, {"max_num_batched_tokens": 8}):
        tight = LLM(str(model_dir), **options)
        outs = tight.generate(batch, params, use_tqdm=False)
        assert [o.text for o in outs] == reference, options
        if "num_kv_blocks" in options:
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the pool was not small enough to preempt"
        stats = tight.kv_cache_stats()
        assert stats["used_blocks"] == 0 and stats["prefix_cache_hits"] > 0


def test_seeded_constrained_requests_are_reproducible_alone_and_batched(llm, prompts) -> None:
    params = [constrained(seed=100 + i, temperature=1.0, json=SCHEMAS["array with min/max items of enums"])
              for i in range(4)]  # n = 4 the way the server runs it: seed + i per choice
    batched = [o.text for o in llm.generate([prompts[1]] * 4, params, use_tqdm=False)]
    alone = [llm.generate(prompts[1], p, use_tqdm=False)[0].text for p in params]
    assert batched == alone and len(set(batched)) > 1


def test_the_same_constraint_compiles_once(llm, prompts) -> None:
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    llm.generate(prompts[:2], constrained(json=schema), use_tqdm=False)
    compiler = llm.engine.grammar_compiler
    first = compiler.compile(constrained(json=schema).structured_outputs)
    assert compiler.compile(constrained(json=json.dumps(schema)).structured_outputs) is first


@pytest.mark.parametrize("constraint, message", [
    ({"regex": "[0-9"}, "structured_outputs.regex cannot be compiled"),
    ({"json": {"type": "no-such-type"}}, "structured_outputs.json"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar cannot be compiled"),
])
def test_a_bad_constraint_is_refused_at_submission(llm, prompts, constraint, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate(prompts[0], constrained(**constraint), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.kv_cache_stats()["used_blocks"] == 0


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["a"]}, "exactly one"), ({"choice": []}, "non-empty"),
    ({"json": "{not json"}, "not valid JSON"), ({"json": [1]}, "JSON schema"), ({"grammar": ""}, "non-empty"),
])
def test_structured_outputs_params_are_checked(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)
