"""The Responses API's routes: `POST /v1/responses` (responses_serving.py runs it), and the stored
responses read back or deleted by id (`GET` / `DELETE /v1/responses/{response_id}`, `GET
/v1/responses/{response_id}/input_items`, OpenAI's cursor page)."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from roseinfer.server.openapi import GENERATION_ERRORS, RESPONSES_OK, error_responses, request_body
from roseinfer.server.protocol import APIError
from roseinfer.server.responses_protocol import RESPONSES_PATH, ResponsesRequest
from roseinfer.server.responses_serving import ResponsesServing
from roseinfer.server.responses_store import ResponseStore
from roseinfer.server.serving import OpenAIServing

STORED_PATH = RESPONSES_PATH + "/{response_id}"
INPUT_ITEMS_PATH = STORED_PATH + "/input_items"
MAX_PAGE = 100  # OpenAI's largest input_items page


def add_responses_routes(app: FastAPI, serving: OpenAIServing, store: ResponseStore, guarded: list[Any]) -> None:
    responses = ResponsesServing(serving, store)
    unauthorized = (401,) if guarded else ()

    @app.post(RESPONSES_PATH, dependencies=guarded, responses={**RESPONSES_OK, **error_responses(*GENERATION_ERRORS)},
              openapi_extra=request_body(ResponsesRequest))
    async def create_response(raw: Request) -> Response:
        """OpenAI's Responses API."""
        return await responses.responses(await serving.parse(ResponsesRequest, raw), raw)

    @app.get(STORED_PATH, dependencies=guarded, responses={
        200: {"description": "the stored Response object", "content": {"application/json": {}}},
        **error_responses(*unauthorized, 404)})
    async def retrieve_response(response_id: str) -> Response:
        """A stored response, as it was sent."""
        return JSONResponse(responses.stored(response_id).response)

    @app.delete(STORED_PATH, dependencies=guarded, responses={
        200: {"description": "the response was deleted", "content": {"application/json": {}}},
        **error_responses(*unauthorized, 404)})
    async def delete_response(response_id: str) -> Response:
        responses.stored(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get(INPUT_ITEMS_PATH, dependencies=guarded, responses={
        200: {"description": "a page of the stored response's own input items", "content": {"application/json": {}}},
        **error_responses(400, *unauthorized, 404)})
    async def list_input_items(response_id: str, after: str | None = None,
                               limit: int = Query(20, ge=1, le=MAX_PAGE),
                               order: Literal["asc", "desc"] = "desc") -> Response:
        """The input items the response was created with (not the earlier turns it continued)."""
        items = responses.stored(response_id).input_items
        items = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), -1)
            if start < 0:
                raise APIError(400, f"after: no input item with id '{after}' in response '{response_id}'", "after")
        page = items[start:start + limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)})
