"""OpenAI's /v1/embeddings: its request body, and each input run as an embedding request through
the same engine manager as generation (serving.py's submit and collect): its prompt is prefilled,
its final hidden state pooled (as the checkpoint's sentence-transformers files say, else the last
token's, L2-normalized: loader/pooling_config.py) and its KV blocks freed; nothing is generated."""
from __future__ import annotations

import base64
import struct
import time
import uuid
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictInt

from roseinfer.engine.llm_engine import EMBEDDING_SAMPLING
from roseinfer.engine.pooling import check_dimensions
from roseinfer.server.protocol import APIError, PromptText, StrictModel, Text, TokenIds
from roseinfer.server.request_params import check_sequences
from roseinfer.server.serving import CLIENT_CLOSED, OpenAIServing

EMBEDDINGS_PATH = "/v1/embeddings"


class EmbeddingsRequest(StrictModel):
    n: ClassVar[int] = 1  # one vector per input (serving.submit's choices per prompt)

    model: Text | None = None
    input: Union[PromptText, Annotated[list[PromptText], Field(min_length=1)], TokenIds,
                 Annotated[list[TokenIds], Field(min_length=1)]]
    encoding_format: Literal["float", "base64"] = "float"
    # the hidden size, or a shorter one a Matryoshka checkpoint declares (engine/pooling.py)
    dimensions: StrictInt | None = Field(None, ge=1)
    user: Text | None = None  # recorded nowhere


class EmbeddingsServing:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def embeddings(self, body: EmbeddingsRequest, raw: Request) -> Response:
        start = time.perf_counter()
        serving = self.serving
        serving.check_model(body.model)
        engine = serving.manager.engine
        pooling = replace(engine.pooling_defaults, dimensions=body.dimensions)
        try:
            check_dimensions(pooling, engine.model_config)
        except ValueError as error:
            raise APIError(400, str(error), "dimensions") from None
        inputs = [body.input] if isinstance(body.input, str) or isinstance(body.input[0], int) else body.input
        check_sequences(len(inputs), 1, serving.max_sequences)
        max_inflight = serving.manager.max_inflight_requests
        if max_inflight is not None and len(inputs) > max_inflight:  # a 429 would be retried forever
            raise APIError(400, f"{len(inputs)} inputs in one request can never run: the server holds at most "
                                f"{max_inflight} in flight (--max-inflight-requests)", "input")
        prompts = [await serving.run_blocking(serving.tokenizer.encode, p) if isinstance(p, str) else list(p)
                   for p in inputs]
        streams = serving.submit(prompts, body, EMBEDDING_SAMPLING, start, None, pooling)
        results = await serving.collect(streams, raw)
        if results is None:
            return Response(status_code=CLIENT_CLOSED)
        failed = next((r for r in results if r.error), None)
        if failed is not None:
            raise APIError(failed.error_status, failed.error)
        tokens = sum(map(len, prompts))
        data = [{"object": "embedding", "index": i, "embedding": encoded(r.embedding or [], body.encoding_format)}
                for i, r in enumerate(results)]
        return JSONResponse({"object": "list", "id": f"embd-{uuid.uuid4().hex}", "data": data,
                             "model": serving.model_name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def encoded(vector: list[float], encoding_format: str) -> Any:
    """OpenAI's base64: the vector's float32 values, little-endian, base64-encoded."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
