"""The output constraint a request asks for, from whichever field it came in: OpenAI's
response_format, vLLM's structured_outputs or its older guided_* fields. One per request.
It is compiled here, in a worker thread, under a size and a time limit, before the request is
submitted: a mistake is a 400 before anything is generated, and an engine in this process takes the
compiled grammar as it is; an engine process compiles its own copy on its compile threads, off its
step loop (engine_client/core_process.py)."""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from roseinfer.engine.structured_output import CompiledGrammar, ConstraintTooLarge
from roseinfer.sampling_params import StructuredOutputsParams
from roseinfer.server.protocol import APIError, JsonObjectFormat, JsonSchemaFormat, SamplingRequest

if TYPE_CHECKING:
    from roseinfer.engine.llm_engine import LLMEngine
    from roseinfer.engine_client.engine_view import EngineView

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from, which errors name


def requested_constraint(body: SamplingRequest, max_bytes: int | None = None) -> Constraint | None:
    """The constraint of response_format, structured_outputs or guided_*; a 400 if two are given,
    or if a schema sent as JSON text is longer than `max_bytes` (it is parsed here)."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(body.response_format, JsonObjectFormat):
        found.append(("response_format", {"json_object": True}))
    elif isinstance(body.response_format, JsonSchemaFormat):
        found.append(("response_format", {"json": body.response_format.json_schema.schema_}))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", body.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    found += [(name, {key: getattr(body, name)}) for name, key in GUIDED_FIELDS.items()
              if getattr(body, name) is not None]
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"{found[0][0]} and {found[1][0]} both constrain the output; give one", found[1][0])
    field, kwargs = found[0]
    text = kwargs.get("json")
    if isinstance(text, str) and max_bytes is not None and len(text.encode()) > max_bytes:
        raise APIError(400, f"{field} is too large: its schema is {len(text.encode())} bytes of JSON text, over the "
                            f"limit of {max_bytes} (--max-constraint-bytes)", field)
    return constraint(field, **kwargs)


def constraint(field: str, **kwargs: Any) -> Constraint:
    """StructuredOutputsParams(**kwargs): a 400 naming `field` if its values are wrong."""
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc) if field == "structured_outputs" else f"{field}: {exc}", field) from None
    return Constraint(params, field)


@dataclass(frozen=True)
class ConstraintLimits:
    max_bytes: int  # --max-constraint-bytes
    compile_timeout: float  # --constraint-compile-timeout, seconds


async def compile_constraint(constraint: Constraint, engine: LLMEngine | EngineView, pool: Executor,
                             limits: ConstraintLimits) -> CompiledGrammar:
    """The constraint compiled in `pool` (llguidance drops the GIL meanwhile); a 400 naming the field
    if it is too large, takes too long, or cannot be enforced. A compile that runs out of time is
    left to finish in its thread (it cannot be stopped) and is cached for the next request."""
    field = constraint.field
    work = asyncio.get_running_loop().run_in_executor(
        pool, partial(engine.compile_grammar, constraint.params, limits.max_bytes))
    try:
        return await asyncio.wait_for(work, limits.compile_timeout)
    except asyncio.TimeoutError:
        raise APIError(400, f"{field} took longer than {limits.compile_timeout:g} s to compile, the server's "
                            "limit (--constraint-compile-timeout)", field) from None
    except ConstraintTooLarge as exc:
        raise APIError(400, f"{field} is too large: {exc} (--max-constraint-bytes)", field) from None
    except ValueError as exc:
        raise APIError(400, f"{field} cannot be enforced: {exc}", field) from None
