"""The load generators' HTTP/1.1 client (roseinfer/bench/http_client.py) against a real uvicorn:
JSON bodies, chunked SSE lines, keep-alive reuse, and a retry when the server closed an idle connection."""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from roseinfer.bench.http_client import HTTPClient
from roseinfer.server.args import ServerOptions
from server_helpers import serve_app

app = FastAPI()


@app.get("/json")
async def plain() -> dict[str, Any]:
    return {"ok": True, "text": "caf\u00e9"}


@app.post("/echo")
async def echo(request: Request) -> Any:
    return await request.json()


@app.post("/sse")
async def sse(request: Request) -> StreamingResponse:
    count = (await request.json())["count"]

    async def events() -> AsyncIterator[str]:
        for i in range(count):
            yield f"data: {i}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def test_bodies_streams_reuse_and_a_closed_idle_connection() -> None:
    options = dataclasses.replace(ServerOptions(), timeout_keep_alive=0.2)
    with serve_app(app, options) as url:
        async def run() -> None:
            async with HTTPClient(url) as client:
                reply = await client.post("/echo", {"a": [1, 2], "b": "\u732b"})
                assert reply.status == 200 and reply.json() == {"a": [1, 2], "b": "\u732b"}
                [connection] = client._idle
                async with client.stream("/sse", {"count": 3}) as streamed:
                    assert streamed.status == 200
                    lines = [line async for line in streamed.lines()]
                assert lines == [b"data: 0", b"", b"data: 1", b"", b"data: 2", b""]
                assert client._idle == [connection]  # the same connection, read to its end each time
                await asyncio.sleep(0.6)  # past the server's keep-alive timeout: it closed the connection
                assert (await client.get("/json")).json() == {"ok": True, "text": "caf\u00e9"}
                missing = await client.get("/missing")
                assert missing.status == 404

        asyncio.run(run())
