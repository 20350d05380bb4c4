"""RequestStream: one request's output deltas, read by an event loop (`async for`) or a thread (`get`),
and their delivery from the engine's worker thread."""
from __future__ import annotations

import asyncio
import queue
import weakref
from collections import deque
from typing import AsyncIterator

from roseinfer.output_processor import StreamDelta


class RequestStream:
    """One request's output as a sequence of StreamDelta, the last one with `finished` set.

    A stream submitted from inside a running event loop is read with `async for` on that loop;
    one submitted from a plain thread is read with `get()`.
    """

    def __init__(self, request_id: str, num_prompt_tokens: int, timings: dict[str, float]) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        # submit_start, tokenized, submit_end, admitted, first_token, finished (perf_counter)
        self.timings = timings
        self.finished = False  # the consumer has received the final delta
        # set by an async reader that writes nothing for a delta without text: such a delta then
        # waits, unread, for the next one that has text (or the final one) to wake the reader
        self.wake_on_text = False
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # a thread consumer's
        # an async consumer's: a deque and a future to wake it, cheaper than asyncio.Queue per token
        self._pending: deque[StreamDelta] = deque()
        self._waiter: asyncio.Future | None = None

    def get(self, timeout: float | None = None) -> StreamDelta:
        """Block for the next delta; TimeoutError after `timeout` seconds."""
        if self._loop is not None:
            raise RuntimeError("this stream was submitted from an event loop; read it with `async for`")
        try:
            delta = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output for request {self.request_id!r} within {timeout}s") from None
        self.finished = delta.finished
        return delta

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        async for batch in self.batches():
            for delta in batch:
                yield delta

    async def batches(self) -> AsyncIterator[list[StreamDelta]]:
        """The deltas in order, each time everything delivered since the reader last took: a reader
        that fell behind catches up in one go (a response writes them as one chunk)."""
        if self._loop is None:
            raise RuntimeError("this stream was submitted outside an event loop; read it with get()")
        pending = self._pending
        while not self.finished:
            if not pending:
                self._waiter = self._loop.create_future()
                await self._waiter
            batch = list(pending)
            pending.clear()
            self.finished = batch[-1].finished
            yield batch


def deliver(deltas: list[tuple[RequestStream, StreamDelta]]) -> None:
    """Hand a step's deltas over: to an async consumer through its loop's inbox, which one
    `call_soon_threadsafe` per loop drains, to a thread consumer through its queue."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, StreamDelta]]] = {}
    for stream, delta in deltas:
        if stream._loop is None:
            stream._queue.put(delta)
        else:
            by_loop.setdefault(stream._loop, []).append((stream, delta))
    for loop, items in by_loop.items():
        inbox = _inboxes.setdefault(loop, deque())
        inbox.extend(items)
        try:
            loop.call_soon_threadsafe(_drain, loop, inbox)
        except RuntimeError:  # the loop is closed: nobody is reading these streams any more
            _inboxes.pop(loop, None)


# What the engine's thread has handed each event loop, oldest first. One turn of a loop runs every
# task woken in the turn before, so a step that ends 256 requests at once would hold everything else
# (/health) back for all their responses: each turn wakes at most WAKE_PER_TURN readers.
_inboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, deque[tuple[RequestStream, StreamDelta]]] = \
    weakref.WeakKeyDictionary()
WAKE_PER_TURN = 32


def _drain(loop: asyncio.AbstractEventLoop, inbox: deque[tuple[RequestStream, StreamDelta]]) -> None:
    woken = 0
    while inbox and woken < WAKE_PER_TURN:
        stream, delta = inbox.popleft()
        stream._pending.append(delta)
        waiter = stream._waiter
        if stream.wake_on_text and not (delta.text or delta.finished):
            continue
        if waiter is not None and not waiter.done():  # done: woken already, or its reader was cancelled
            waiter.set_result(None)
            woken += 1
    if inbox:
        loop.call_soon(_drain, loop, inbox)  # the rest next turn, after the sockets are read
