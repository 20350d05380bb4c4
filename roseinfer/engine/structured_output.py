"""Structured output: each constrained request carries a grammar matcher (llguidance) that says,
before every sampled token, which tokens may come next; the step's masks are filled for all
constrained rows in one parallel call and applied to the logits before sampling.

Why llguidance and not xgrammar: benchmarks/grammar_mask.py and docs/structured_output.md.
"""
from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
# its numpy helpers, not its torch ones: llguidance.torch imports torch's compiler stack (torch.compile
# at import), seconds of every engine's start; the masks are CPU tensors, which .numpy() shares
import llguidance.numpy
import torch

from roseinfer.platforms import platform_for
from roseinfer.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Between JSON tokens: nothing, a space, or a newline and up to 20 indentation characters (llama.cpp's
# rule). Unbounded whitespace would let a model loop on it forever; none at all would fight the
# "key": value spacing models are trained on. A schema's own "x-guidance" options override it.
JSON_WHITESPACE = r"(?: |\n[ \t]{0,20})?"
MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2
# llguidance recurses once per nested rule as it compiles, so a deep grammar overflows a thread's default
# stack; this covers --max-constraint-bytes' default (reserved address space, used only as deep as needed)
COMPILE_STACK_BYTES = 256 << 20
MAX_LOGGED_ERROR = 300  # characters of a grammar error in the log: a message may quote the grammar


class ConstraintTooLarge(ValueError):
    """The constraint's grammar text is longer than the caller's limit (refused before compiling)."""


@dataclass(frozen=True)
class CompiledGrammar:
    """A compiled constraint, shared by every request that asks for it: each sequence follows its own copy."""

    template: llguidance.LLMatcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy())


class GrammarCompiler:
    """Compiles each distinct constraint once (an LRU of compiled grammars). Thread-safe, so a
    server compiles in its own threads (llguidance drops the GIL meanwhile) and hands the result
    to the engine; the engine compiles only what reaches it uncompiled."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams, max_bytes: int | None = None) -> CompiledGrammar:
        """The compiled constraint; ValueError names what is wrong with it, ConstraintTooLarge that its
        grammar text is over `max_bytes` (None: no limit)."""
        key = json.dumps([params.kind, getattr(params, params.kind)], sort_keys=True)
        with self._lock:
            compiled = self._compiled.get(key)
            if compiled is not None:
                self._compiled.move_to_end(key)
                return compiled
        grammar = _grammar(params)
        size = len(grammar.encode())
        if max_bytes is not None and size > max_bytes:
            raise ConstraintTooLarge(f"its grammar is {size} bytes, over the limit of {max_bytes}")
        try:
            # verbose_errors off: llguidance's verbose messages quote the whole grammar
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                           limits=llguidance.LLParserLimits(verbose_errors=False))
        except ValueError as exc:  # a JSON schema llguidance cannot even read
            raise _compile_error(params, str(exc)) from None
        if matcher.is_error():
            raise _compile_error(params, matcher.get_error())
        error = _first_token_error(matcher, self.vocab_size)
        if error:
            raise ValueError(f"structured_outputs.{params.kind}: llguidance gives up on it at its first token: "
                             f"{_one_line(error)}")
        compiled = CompiledGrammar(matcher)
        with self._lock:
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled


def compile_pool() -> ThreadPoolExecutor:
    """The threads constraints compile in: their own, so that a slow compile holds no other request's
    parsing or tokenizing, and with a deep stack. Both are started here, while the stack size is set."""
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="roseinfer-grammar")
        started = threading.Barrier(COMPILE_THREADS)  # each waits for the other: two threads, not one reused
        for waiting in [pool.submit(started.wait) for _ in range(COMPILE_THREADS)]:
            waiting.result()
    finally:
        threading.stack_size(previous)
    return pool


def _first_token_error(matcher: llguidance.LLMatcher, vocab: int) -> str | None:
    """Why llguidance gives up on a grammar as soon as its first allowed token is taken, if it does.
    Some grammars compile and fail only then (a{1000000}: its lexer needs more states than its
    limits allow), which a copy finds here, before a request is queued; the lexer states it builds
    on the way are shared with the copies requests get."""
    probe = matcher.deep_copy()
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    llguidance.numpy.fill_next_token_bitmask(probe, bitmask.numpy())  # drops the GIL, as compiling does
    allowed = allowed_tokens(bitmask, vocab)[0].nonzero()
    if not probe.is_error() and len(allowed):
        probe.consume_token(int(allowed[0]))
    return probe.get_error() if probe.is_error() else None


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
        """Advance by a sampled token; False if the grammar refuses it: llguidance gave up on the
        grammar (a limit on its work per token), or the mask failed to hold (`error` says which).
        A grammar's lexer is shared by its copies, so one that gave up fails the others too: their
        mask then allows only end-of-sequence, which is accepted in the error state, hence is_error."""
        if self.matcher.consume_token(token) and not self.matcher.is_error():
            return True
        logger.warning("the grammar refused token %d: %s", token, self.error[:MAX_LOGGED_ERROR])
        return False

    @property
    def error(self) -> str:
        """llguidance's reason for its error state, in one line."""
        return _one_line(self.matcher.get_error() or "the grammar refused the sampled token")

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
        llguidance.numpy.fill_next_token_bitmask_par(
            self.executor, [(m.matcher, j) for j, m in enumerate(matchers)], bitmask.numpy())
        bitmask = platform_for(logits.device).upload(bitmask)
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
