"""uvicorn's h11 HTTP/1.1 protocol with the two guards on a request's head that nginx has and uvicorn
lacks: a size limit (431) and a time limit (408).

Why h11 and not httptools (uvicorn's pick when it is installed): httptools has no header limit, so a
head of any size is read and buffered before authentication. h11 caps its buffer of an
incomplete head (`h11_max_incomplete_event_size`, which uvicorn passes on), but only once a read
ends without the head complete: a larger head that arrives in one read passes. So the head is
measured here, on every read, before h11 sees it; h11's own cap stays as the backstop for a head
pipelined behind a request still being answered.

uvicorn times a connection out only between requests (--timeout-keep-alive, disarmed by the first
byte): a connection that never sends a byte, or sends a head one byte at a time (slowloris), would
be held forever. Here a connection waiting for a head gets --header-timeout seconds to complete it.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from roseinfer.server.protocol import error_body

HEAD_END = re.compile(rb"\r?\n\r?\n")  # h11 accepts bare \n line ends too
REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class GuardedH11Protocol(H11Protocol):
    """Built by uvicorn per connection; `header_timeout` is bound with functools.partial, the size
    limit comes from the config's h11_max_incomplete_event_size."""

    def __init__(self, *args: Any, header_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.max_head_bytes: int = self.config.h11_max_incomplete_event_size
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # reading a head: measure it before h11 buffers it
            pending = self.conn.trailing_data[0] + data
            end = HEAD_END.search(pending, 0, self.max_head_bytes + 4)
            if (end.end() if end else len(pending)) > self.max_head_bytes:
                self._refuse(431, f"the request line and headers are larger than the server's limit of "
                                  f"{self.max_head_bytes} bytes (--max-header-kb)")
                return
        super().data_received(data)
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def _watch_head(self) -> None:
        """Arm the head timer while the connection waits for a request's head, disarm it once the
        head is in (the request's own time is the engine's business)."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        elif not waiting:
            self._stop_head_timer()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why, as nginx does
            self._refuse(408, f"the request's head did not arrive within {self.header_timeout:g}s (--header-timeout)")
        else:  # nothing came: an idle connection is closed without a word
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answer and close. Written past h11, whose state machine sends a response only to a
        request it has parsed; the connection ends here anyway."""
        self._stop_head_timer()
        self.logger.warning("refused a connection from %s: %s", self.client, message)
        body = json.dumps(error_body(status, message)).encode()
        head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
                % (status, REASONS[status], len(body)))
        self.transport.write(head + body)
        self.transport.close()
