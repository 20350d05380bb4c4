"""The output constraint a request asks for, from whichever field it came in: OpenAI's
response_format, vLLM's structured_outputs or its older guided_* fields. One per request."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roseinfer.engine.structured_output import constraint_error
from roseinfer.sampling_params import StructuredOutputsParams
from roseinfer.server.protocol import APIError, JsonObjectFormat, JsonSchemaFormat, SamplingRequest

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    params: StructuredOutputsParams
    field: str  # the request field it came from, which errors name


def requested_constraint(body: SamplingRequest) -> Constraint | None:
    """The constraint of response_format, structured_outputs or guided_*; a 400 if two are given."""
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
    return constraint(found[0][0], **found[0][1])


def constraint(field: str, **kwargs: Any) -> Constraint:
    """StructuredOutputsParams(**kwargs), checked now: a 400 naming `field` if it cannot be enforced."""
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc) if field == "structured_outputs" else f"{field}: {exc}", field) from None
    # the engine compiles it again at add_request, in its worker thread, where a mistake could no
    # longer be a 400 before a stream has begun
    error = constraint_error(params)
    if error:
        raise APIError(400, f"{field} cannot be enforced: {error}", field)
    return Constraint(params, field)
