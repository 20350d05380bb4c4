"""Request bodies larger than the limit are answered 413 before anything parses them.

An ASGI middleware rather than a check in the handlers: FastAPI reads and parses the whole body
before a handler runs, so an oversized prompt would hold the event loop before it is refused. A
declared Content-Length over the limit is refused without reading a byte; a chunked body is
counted as it arrives and refused at the first byte past the limit. What passes is handed on
whole, then the client's later messages (its disconnect) as they come.
"""
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from roseinfer.server.protocol import error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int,
                 on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject  # counts the refusal (metrics)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        body = json.dumps(error_body(413, f"the request body is larger than the server's limit of "
                                          f"{self.max_bytes} bytes (--max-request-body-mb)")).encode()
        # the unread rest of the body makes the connection unusable: close it after answering
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
