"""How roseinfer chose its grammar library: llguidance against xgrammar on this machine.

For each library: the cold compile of a JSON schema, then B matchers walking a valid output in
lockstep (compact JSON: no free whitespace, as the engine asks), timing per step the batched mask fill and the token advance, and the coverage of a set
of schema features. Either library may be absent (xgrammar is not a dependency: pip install it).

    python benchmarks/grammar_mask.py [--model FOLDER] [--batch-sizes 1,16] [--steps 64] [--engine]

With --engine, also roseinfer's own decode step with every row constrained by a JSON schema
against the same batch free, alternating rounds in one process (the schema cannot complete within
the 64 tokens and EOS is ignored, so both decode the same number of tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

import torch

from roseinfer.engine.structured_output import allowed_tokens
from roseinfer.loader.model_loader import resolve_model_folder

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "email", "tags", "address"],
    "additionalProperties": False,
}
FEATURES: dict[str, dict[str, Any]] = {
    "nested objects + arrays": SCHEMA,
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
                   "type": "array", "items": {"$ref": "#/$defs/p"}},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "number bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 10},
    "string format date-time": {"type": "string", "format": "date-time"},
    "recursive $ref": {"$defs": {"node": {"type": "object", "properties": {"kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
}


def llguidance_library(folder: str, vocab: int) -> dict[str, Callable]:
    import llguidance
    import llguidance.torch
    from tokenizers import Tokenizer

    tok = llguidance.LLTokenizer(Tokenizer.from_file(f"{folder}/tokenizer.json").to_str(), n_vocab=vocab)
    executor = llguidance.LLExecutor()

    def compile_(schema: dict) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), {"whitespace_flexible": False})
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise ValueError(error)
        return grammar

    def matchers(grammar: Any, n: int) -> list:
        return [llguidance.LLMatcher(tok, grammar) for _ in range(n)]

    def fill(ms: list, bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(ms)], bitmask)

    def advance(ms: list, tokens: list[int]) -> None:
        for m, t in zip(ms, tokens):
            m.consume_token(t)

    return {"compile": compile_, "matchers": matchers, "fill": fill, "advance": advance,
            "alloc": llguidance.torch.allocate_token_bitmask}


def xgrammar_library(folder: str, vocab: int) -> dict[str, Callable]:
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    info = xgrammar.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=f"{folder}/tokenizer.json"),
                                                   vocab_size=vocab)
    batch = xgrammar.BatchGrammarMatcher()

    def compile_(schema: dict) -> Any:
        return xgrammar.GrammarCompiler(info, cache_enabled=False).compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matchers(grammar: Any, n: int) -> list:
        return [xgrammar.GrammarMatcher(grammar) for _ in range(n)]

    def fill(ms: list, bitmask: torch.Tensor) -> None:
        batch.batch_fill_next_token_bitmask(ms, bitmask)

    def advance(ms: list, tokens: list[int]) -> None:
        xgrammar.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    return {"compile": compile_, "matchers": matchers, "fill": fill, "advance": advance,
            "alloc": xgrammar.allocate_token_bitmask}


def walk(lib: dict[str, Callable], grammar: Any, batch: int, steps: int, vocab: int) -> tuple[float, float]:
    """Mean ms per step of the batched mask fill and of the token advance."""
    ms, gen = lib["matchers"](grammar, batch), torch.Generator().manual_seed(0)
    bitmask = lib["alloc"](batch, vocab)
    fills, advances = [], []
    for _ in range(steps):
        start = time.perf_counter()
        lib["fill"](ms, bitmask)
        fills.append(time.perf_counter() - start)
        scores = torch.rand(batch, vocab, generator=gen).masked_fill(~allowed_tokens(bitmask, vocab), -1.0)
        tokens = scores.argmax(dim=1).tolist()
        start = time.perf_counter()
        lib["advance"](ms, tokens)
        advances.append(time.perf_counter() - start)
    return statistics.mean(fills) * 1e3, statistics.mean(advances) * 1e3


def engine_steps(model: str | None, batch_sizes: list[int], rounds: int = 3) -> None:
    from roseinfer import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(model, enforce_eager=True)
    prompt = llm.apply_chat_template([{"role": "user", "content": "Describe the sea in lowercase words."}])
    # a string longer than 64 tokens can hold: the schema never completes, so both modes decode 64 tokens
    long_text = {"type": "object", "properties": {"description": {"type": "string", "minLength": 1000}},
                 "required": ["description"]}
    modes = {"free": None, "json schema": StructuredOutputsParams(json=long_text)}
    for batch in batch_sizes:
        steps: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(rounds):
            for mode, constraint in modes.items():
                params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, structured_outputs=constraint)
                for out in llm.generate([prompt] * batch, params, use_tqdm=False):
                    steps[mode].append((out.metrics["finished"] - out.metrics["first_token"]) / (len(out.token_ids) - 1))
        free, constrained = (statistics.median(steps[m]) * 1e3 for m in modes)
        print(f"engine: batch {batch}: decode step free {free:.2f} ms ({batch * 1e3 / free:.1f} tok/s), json schema "
              f"{constrained:.2f} ms ({batch * 1e3 / constrained:.1f} tok/s), tok/s ratio {free / constrained:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: the default model)")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--engine", action="store_true", help="also time roseinfer's decode step, free vs constrained")
    args = parser.parse_args()
    folder = str(resolve_model_folder(args.model))
    vocab = json.load(open(f"{folder}/config.json"))["vocab_size"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the libraries' own thread pools do the work
    for name, build in (("llguidance", llguidance_library), ("xgrammar", xgrammar_library)):
        try:
            lib = build(folder, vocab)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        start = time.perf_counter()
        grammar = lib["compile"](SCHEMA)
        lib["matchers"](grammar, 1)
        print(f"{name}: compile and first matcher {1e3 * (time.perf_counter() - start):.1f} ms")
        for batch in map(int, args.batch_sizes.split(",")):
            fill, advance = walk(lib, grammar, batch, args.steps, vocab)
            print(f"{name}: batch {batch}: mask fill {fill:.3f} ms/step, advance {advance:.3f} ms/step")
        failed = []
        for feature, schema in FEATURES.items():
            try:
                lib["compile"](schema)
            except Exception as exc:  # noqa: BLE001 - any refusal counts as not covered
                failed.append(f"{feature} ({str(exc).splitlines()[0][:80]})")
        print(f"{name}: schema features compiled {len(FEATURES) - len(failed)}/{len(FEATURES)}"
              + (f"; refused: {'; '.join(failed)}" if failed else ""))
    if args.engine:
        torch.set_num_threads(threads)
        engine_steps(args.model, [int(b) for b in args.batch_sizes.split(",")])


if __name__ == "__main__":
    main()
