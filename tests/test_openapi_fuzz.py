"""Schemathesis over the server's own /openapi.json: generated requests, valid and invalid, never
get a 5xx, and every response conforms to the document (status codes, content types, bodies).
Bounded so that the whole run stays under a minute on two cores."""
from __future__ import annotations

from typing import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.server.app import build_app
from roseinfer.server.args import ServerOptions
from server_helpers import serve_app

# positive_data_acceptance is left out on purpose: a request the schema allows may still be refused
# for what only the server knows (another model's name, a prompt longer than the context)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance, negative_data_rejection]


@pytest.fixture(scope="module")
def api_schema(tiny_model_factory) -> Iterator[schemathesis.BaseSchema]:
    engine = LLMEngine(EngineConfig(model=str(tiny_model_factory("llama")), num_kv_blocks=64))
    # few sequences per request keep each generated request short
    with serve_app(build_app(engine, "tiny", ServerOptions(max_sequences_per_request=4, max_inflight_requests=8))) as url:
        yield schemathesis.openapi.from_url(f"{url}/openapi.json")


# Hypothesis strategies per operation rather than schemathesis' pytest plugin, whose lazy fixture
# loader breaks on pytest 9.2 (it sets Function._nodeid, which pytest no longer has)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_server_errors_and_responses_conform_to_the_document(api_schema: schemathesis.BaseSchema,
                                                               mode: GenerationMode) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items", "POST /v1/embeddings",
        "POST /v1/messages", "POST /v1/messages/count_tokens", "GET /v1/models", "POST /tokenize", "POST /detokenize",
        "GET /health", "GET /metrics"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (len(operation.body) or len(operation.query)):
            continue  # nothing to get wrong without a body or a query (any path segment is a string)
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.explicit, Phase.generate])
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=30)

        check()
