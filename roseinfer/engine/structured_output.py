"""Structured output: each constrained request carries a grammar matcher (llguidance) that says,
before every sampled token, which tokens may come next; the step's masks are filled for all
constrained rows in one parallel call and applied to the logits before sampling.

Why llguidance and not xgrammar: benchmarks/grammar_mask.py and docs/structured_output.md.
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict

import llguidance
import llguidance.torch
import torch

from roseinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Between JSON tokens: nothing, a space, or a newline and up to 20 indentation characters (llama.cpp's
# rule). Unbounded whitespace would let a model loop on it forever; none at all would fight the
# "key": value spacing models are trained on. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
MAX_CACHED_GRAMMARS = 256


class GrammarCompiler:
    """Compiles each distinct constraint once (an LRU of ready matchers); every request gets a
    copy of the compiled one. Built on the first constrained request: wrapping the tokenizer
    takes a moment for a large vocabulary."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence; ValueError names what is wrong with the constraint."""
        key = json.dumps([params.kind, getattr(params, params.kind)], sort_keys=True)
        compiled = self._compiled.get(key)
        if compiled is None:
            try:
                compiled = llguidance.LLMatcher(self.tokenizer, _grammar(params), log_level=0)
            except ValueError as exc:  # a JSON schema llguidance cannot even read
                raise _compile_error(params, str(exc)) from None
            if compiled.is_error():
                raise _compile_error(params, compiled.get_error())
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return GrammarMatcher(compiled.deep_copy())


def constraint_error(params: StructuredOutputsParams) -> str | None:
    """Why GrammarCompiler.matcher would refuse the constraint, in one line, found without a
    tokenizer: the server asks before it answers, where the answer can still be a 400."""
    try:
        error = llguidance.LLMatcher.validate_grammar(_grammar(params))
    except ValueError as exc:  # a JSON schema llguidance cannot even read
        return str(exc)
    return _one_line(error) if error else None


def _compile_error(params: StructuredOutputsParams, error: str) -> ValueError:
    return ValueError(f"structured_outputs.{params.kind} cannot be compiled: {_one_line(error)}")


def _grammar(params: StructuredOutputsParams) -> str:
    if params.json is not None or params.json_object:
        schema = params.json if params.json is not None else {"type": "object"}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, {"whitespace_pattern": JSON_WHITESPACE})
    if params.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        # JSON string literals are Lark string literals: quotes and newlines come escaped
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    return llguidance.LLMatcher.grammar_from_lark(params.grammar)


def _one_line(error: str) -> str:
    """llguidance's message head and its "error:" detail, without the source excerpt drawn under it."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    detail = next((line.removeprefix("error:").strip() for line in lines[1:] if line.startswith("error:")), None)
    return f"{lines[0]} {detail}" if detail else lines[0]


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it (the mask should have)."""
        if self.matcher.consume_token(token):
            return True
        logger.error("the grammar refused token %d that its mask allowed: %s", token, self.matcher.get_error())
        return False

    @property
    def is_complete(self) -> bool:
        """Nothing but the end of the output can follow."""
        return self.matcher.is_stopped()


class GrammarMasks:
    """Fills the step's token masks for the constrained rows (llguidance's thread pool, one call)
    and applies them to the logits."""

    def __init__(self) -> None:
        self.executor = llguidance.LLExecutor()

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher]) -> torch.Tensor:
        """logits with every token the grammar forbids at -inf in the given rows (a new tensor)."""
        vocab = logits.shape[1]
        bitmask = torch.empty(len(rows), (vocab + 31) // 32, dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask_par(
            self.executor, [(m.matcher, j) for j, m in enumerate(matchers)], bitmask)
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory()
        bitmask = bitmask.to(logits.device, non_blocking=True)
        allowed = allowed_tokens(bitmask, vocab)
        out = logits.clone()
        if len(rows) == logits.shape[0]:
            return out.masked_fill_(~allowed, float("-inf"))
        index = torch.tensor(rows, device=logits.device)
        out[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return out


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """llguidance's [R, ceil(V / 32)] int32 words as [R, V] bools, True where a token may come next."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
