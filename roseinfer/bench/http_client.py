"""A small HTTP/1.1 client over asyncio streams, for the load generators (``bench serve``,
benchmarks/server_overhead.py): keep-alive connections, JSON request bodies, responses framed by
Content-Length or chunked, a streamed body read line by line (SSE).

Why not httpx: on a machine whose cores the server needs, a load client's own CPU is part of what a
run measures, and httpx's layers cost about as much per streamed token as the server does. This one
does only what a load client needs: no proxies, no redirects, no compression, no cookies.
"""
from __future__ import annotations

import asyncio
import ssl
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import msgspec


class HTTPStatusError(Exception):
    """A response whose status is not 2xx, where the caller asked for one."""


@dataclass
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return msgspec.json.decode(self.body)

    def raise_for_status(self) -> None:
        if not 200 <= self.status < 300:
            raise HTTPStatusError(f"HTTP {self.status}: {self.body[:500].decode('utf-8', errors='replace')}")


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def head(self) -> tuple[int, dict[bytes, bytes]]:
        """The status and the headers (names lowercased) of the next response."""
        lines = (await self.reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            if name:
                headers[name.strip().lower()] = value.strip()
        return status, headers

    async def chunks(self, headers: dict[bytes, bytes]) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk of a chunked body, or the whole of any other."""
        if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while await self.reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                        pass
                    return
                yield (await self.reader.readexactly(size + 2))[:-2]
        elif b"content-length" in headers:
            yield await self.reader.readexactly(int(headers[b"content-length"]))
        else:  # delimited by the connection's end
            yield await self.reader.read()

    def close(self) -> None:
        self.writer.close()


class StreamedReply:
    """A response whose body is read as it comes: `lines()` for SSE, `read()` for the rest at once."""

    def __init__(self, status: int, headers: dict[bytes, bytes], connection: _Connection) -> None:
        self.status, self._headers, self._connection = status, headers, connection
        self.consumed = False

    async def read(self) -> bytes:
        body = b"".join([chunk async for chunk in self._connection.chunks(self._headers)])
        self.consumed = True
        return body

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines, without their line ends."""
        pending = b""
        async for chunk in self._connection.chunks(self._headers):
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                yield line[:-1] if line.endswith(b"\r") else line
        self.consumed = True
        if pending:
            yield pending


class HTTPClient:
    """Requests to one server (`base_url`, http or https), each on an idle keep-alive connection or a
    new one; `headers` go with every request."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"{base_url!r}: only http:// and https:// URLs are supported")
        self.base_url = base_url.rstrip("/")
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._host = url.hostname or "localhost"
        self._port = url.port or (443 if self._ssl else 80)
        self._prefix = url.path.rstrip("/")
        host = url.netloc.rsplit("@", 1)[-1]
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, **(headers or {})}.items())
        self._idle: list[_Connection] = []

    async def get(self, path: str) -> Reply:
        async with self._exchange("GET", path, None) as reply:
            return Reply(reply.status, await reply.read())

    async def post(self, path: str, payload: Any) -> Reply:
        async with self._exchange("POST", path, payload) as reply:
            return Reply(reply.status, await reply.read())

    def stream(self, path: str, payload: Any) -> AbstractAsyncContextManager[StreamedReply]:
        """`async with client.stream(path, payload) as reply:` a POST whose body is read as it comes."""
        return self._exchange("POST", path, payload)

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    async def __aenter__(self) -> HTTPClient:
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.aclose()

    @asynccontextmanager
    async def _exchange(self, method: str, path: str, payload: Any) -> AsyncIterator[StreamedReply]:
        body = b"" if payload is None else msgspec.json.encode(payload)
        kind = "Content-Type: application/json\r\n" if payload is not None else ""
        request = (f"{method} {self._prefix}{path} HTTP/1.1\r\n{self._fixed}{kind}Content-Length: {len(body)}\r\n\r\n"
                   ).encode() + body
        connection, reused = await self._connection()
        try:
            connection.writer.write(request)
            await connection.writer.drain()
            status, headers = await connection.head()
        except (ConnectionError, asyncio.IncompleteReadError):
            connection.close()
            if not reused:
                raise
            # the server closed an idle connection meanwhile (its keep-alive timeout): once more on a new one
            connection, _ = await self._connection(fresh=True)
            connection.writer.write(request)
            await connection.writer.drain()
            status, headers = await connection.head()
        reply = StreamedReply(status, headers, connection)
        try:
            yield reply
        finally:  # a connection is reused only once its response was read to the end
            if reply.consumed and headers.get(b"connection", b"").lower() != b"close" and (
                    b"content-length" in headers or b"transfer-encoding" in headers):
                self._idle.append(connection)
            else:
                connection.close()

    async def _connection(self, fresh: bool = False) -> tuple[_Connection, bool]:
        if self._idle and not fresh:
            return self._idle.pop(), True
        reader, writer = await asyncio.open_connection(self._host, self._port, ssl=self._ssl, limit=1 << 20)
        return _Connection(reader, writer), False
