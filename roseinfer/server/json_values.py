"""What every value of a request's JSON must be, checked before anything reads it: text that is
valid Unicode (also every key and string inside free-form JSON), and integers as JSON Schema counts
them (2.0 is 2). protocol.py's request models apply these.
"""
from __future__ import annotations

from itertools import chain
from typing import Any, get_args


def _surrogate_at(text: str) -> int | None:
    # JSON may carry "\ud800" escapes: Python keeps them as lone surrogates, which no UTF-8 coder takes
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def valid_unicode(text: str) -> str:
    at = _surrogate_at(text)
    if at is not None:
        raise ValueError(f"text holds an unpaired surrogate at index {at} (not valid Unicode)")
    return text


def valid_unicode_json(value: Any) -> Any:
    """Every key and string inside a free-form JSON value checked as text is (iterative: no depth limit)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            at = _surrogate_at(item)
            if at is not None:
                raise ValueError(f"the string {item[:40]!r} holds an unpaired surrogate at index {at} "
                                 "(not valid Unicode)")
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            stack += item
    return value


def integral(value: Any) -> Any:
    """2.0 as 2, alone or in a list or a list of lists: JSON Schema's "integer" takes it (2.5, "2" and
    true stay refused). The scans that find no float, as a request's token ids give, run in C."""
    if type(value) is float:
        return int(value) if value.is_integer() else value
    if type(value) is not list:
        return value
    if list in map(type, value):
        try:
            if float not in map(type, chain.from_iterable(value)):
                return value
        except TypeError:  # lists mixed with numbers: validation refuses them
            return value
        return [integral(row) for row in value]
    return [integral(v) for v in value] if float in map(type, value) else value


def takes_int(annotation: Any) -> bool:
    """Whether a field's type holds an int anywhere: int | None, list[int], Annotated[int, ...]."""
    return annotation is int or any(takes_int(arg) for arg in get_args(annotation))
