"""Request bodies parsed and validated in a worker thread, with cheap count checks first.

FastAPI parses and validates a body on the event loop, where a body of millions of small values
holds every other request for seconds. Here a handler hands the raw bytes to a worker thread,
which parses them, counts what the limits below cap (prompts, messages, choices, stop strings, ...)
before pydantic walks anything, and only then validates. The C JSON parser holds the GIL for the
whole body, so a body that may hold more values than any request needs (counted from its commas
and brackets, which strings may hold too) goes through the stdlib's pure-Python scanner instead,
which gives the GIL back between values and stops at the budget.
"""
from __future__ import annotations

import json
import json.scanner
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from roseinfer.server.protocol import MAX_TOOLS, APIError
from roseinfer.server.request_params import check_sequences

MAX_JSON_CONTAINERS = 100_000  # arrays and objects in one body: far more than any request needs
MAX_JSON_VALUES = 1_000_000  # arrays, objects, strings and numbers: 256 prompts of 4,096 token ids
MAX_MESSAGES = 2048  # chat messages, and content parts and tool calls in all of them
MAX_CHOICES = 1000  # guided_choice entries; llguidance gives up on a grammar row of 2,000 alternatives
MAX_STOP = 16  # stop strings; each is searched for in every step's text
MAX_LOGIT_BIAS = 1024  # logit_bias entries
M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class BodyLimits:
    max_prompts: int  # prompts x n: --max-sequences-per-request
    max_token_ids: int  # in one prompt, list of stop_token_ids or /detokenize: the model's context


def parse_body(model: type[M], raw: bytes, limits: BodyLimits) -> M:
    """The validated body; APIError (400) for a limit or bad JSON, RequestValidationError for the rest."""
    data = _load(raw)
    if isinstance(data, dict):
        check_counts(data, limits)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False, include_input=False)) from None


def _load(raw: bytes) -> Any:
    try:
        if _surely_small(raw):
            return json.loads(raw)
        return _BudgetDecoder().decode(raw.decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {getattr(exc, 'msg', exc)}") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None


def _surely_small(text: bytes | str) -> bool:
    """JSON text within both budgets by its brackets and commas (upper bounds: strings may hold some)."""
    brackets, comma = ("[", "{"), ","
    if isinstance(text, bytes):
        brackets, comma = (b"[", b"{"), b","
    containers = text.count(brackets[0]) + text.count(brackets[1])
    return containers <= MAX_JSON_CONTAINERS and containers + text.count(comma) < MAX_JSON_VALUES


class _BudgetDecoder(json.JSONDecoder):
    """The stdlib decoder on its pure-Python scanner, refusing the body past MAX_JSON_CONTAINERS
    arrays and objects or MAX_JSON_VALUES values (true, false and null are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        left = {"arrays and objects": MAX_JSON_CONTAINERS, "values": MAX_JSON_VALUES}

        def counted(parse: Callable[..., Any], *budgets: str) -> Callable[..., Any]:
            def parse_counted(*args: Any) -> Any:
                for budget in budgets:
                    left[budget] -= 1
                    if left[budget] < 0:
                        limit = MAX_JSON_CONTAINERS if budget == "arrays and objects" else MAX_JSON_VALUES
                        raise APIError(400, f"the body holds more than {limit} JSON {budget}")
                return parse(*args)
            return parse_counted

        self.parse_array = counted(self.parse_array, "arrays and objects", "values")
        self.parse_object = counted(self.parse_object, "arrays and objects", "values")
        self.parse_string = counted(self.parse_string, "values")
        self.parse_int = counted(self.parse_int, "values")
        self.parse_float = counted(self.parse_float, "values")
        self.scan_once = json.scanner.py_make_scanner(self)


def check_counts(data: dict[str, Any], limits: BodyLimits) -> None:
    """Each capped list or map in a parsed body, by its length alone (types are pydantic's to check)."""
    structured = data.get("structured_outputs")
    caps: list[tuple[str, Any, int, str]] = [
        ("messages", data.get("messages"), MAX_MESSAGES, ""),
        ("tools", data.get("tools"), MAX_TOOLS, ""),
        ("stop", data.get("stop"), MAX_STOP, ""),
        ("stop_sequences", data.get("stop_sequences"), MAX_STOP, ""),  # /v1/messages' stop
        ("logit_bias", data.get("logit_bias"), MAX_LOGIT_BIAS, ""),
        ("guided_choice", data.get("guided_choice"), MAX_CHOICES, ""),
        ("structured_outputs.choice", structured.get("choice") if isinstance(structured, dict) else None,
         MAX_CHOICES, ""),
        ("stop_token_ids", data.get("stop_token_ids"), limits.max_token_ids, " (the model's context)"),
        ("tokens", data.get("tokens"), limits.max_token_ids, " (the model's context)"),
    ]
    messages = data.get("messages")
    if isinstance(messages, list):
        lists = [m[key] for m in messages if isinstance(m, dict) for key in ("content", "tool_calls")
                 if isinstance(m.get(key), list)]
        caps.append(("messages", range(sum(map(len, lists))), MAX_MESSAGES, " content parts and tool calls in all"))
        # tool-call arguments are JSON text that validation parses, with the C parser: the same budgets
        if not all(_surely_small(call["function"]["arguments"]) for calls in lists for call in calls
                   if isinstance(call, dict) and isinstance(call.get("function"), dict)
                   and isinstance(call["function"].get("arguments"), str)):
            raise APIError(400, "messages: a tool call's arguments may hold more than "
                                f"{MAX_JSON_CONTAINERS} JSON arrays and objects or {MAX_JSON_VALUES} values", "messages")
    items = data.get("input")  # /v1/responses' items, /v1/embeddings' inputs (not one prompt's token ids)
    if isinstance(items, list) and items and not isinstance(items[0], int):
        caps.append(("input", items, MAX_MESSAGES, ""))
    prompt = data.get("prompt")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            caps.append(("prompt", prompt, limits.max_token_ids, " token ids (the model's context)"))
        else:
            n = data.get("n")
            check_sequences(len(prompt), n if isinstance(n, int) and n >= 1 else 1, limits.max_prompts)
            caps += [("prompt", p, limits.max_token_ids, " token ids in one prompt (the model's context)")
                     for p in prompt if isinstance(p, list)]
    for name, value, cap, what in caps:
        if isinstance(value, (list, dict, range)) and len(value) > cap:
            raise APIError(400, f"{name} holds {len(value)} entries; this server takes at most {cap}{what}", name)
