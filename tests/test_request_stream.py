"""RequestStream's delivery to event-loop readers: every delta in order, and a step's burst woken a
bounded number of readers per turn of the loop (so that one step cannot hold /health back)."""
from __future__ import annotations

import asyncio
from collections import Counter

from roseinfer.engine_client.request_stream import WAKE_PER_TURN, RequestStream, deliver
from roseinfer.output_processor import StreamDelta


def _delta(count: int, finished: bool) -> StreamDelta:
    return StreamDelta("x", [1], [], finished, "length" if finished else None, 1, count, 0.0)


def test_a_burst_reaches_every_reader_in_order_a_slice_per_loop_turn() -> None:
    async def run() -> tuple[dict[str, list[int]], Counter]:
        loop = asyncio.get_running_loop()
        turn = [0]

        def tick() -> None:
            turn[0] += 1
            if not done.is_set():
                loop.call_soon(tick)

        done = asyncio.Event()
        streams = [RequestStream(f"r{i}", 1, {}) for i in range(3 * WAKE_PER_TURN + 5)]
        got: dict[str, list[int]] = {s.request_id: [] for s in streams}
        first_turns: Counter = Counter()

        async def read(stream: RequestStream) -> None:
            async for delta in stream:
                if not got[stream.request_id]:
                    first_turns[turn[0]] += 1
                got[stream.request_id].append(delta.num_output_tokens)

        readers = [asyncio.create_task(read(s)) for s in streams]
        await asyncio.sleep(0)  # every reader waits for its first delta
        tick()
        # two steps handed over at once from another thread, as the engine client's output thread does
        await asyncio.to_thread(deliver, [(s, _delta(k + 1, k == 2)) for k in range(3) for s in streams])
        await asyncio.gather(*readers)
        done.set()
        return got, first_turns

    got, first_turns = asyncio.run(run())
    assert all(counts == [1, 2, 3] for counts in got.values())
    assert max(first_turns.values()) <= WAKE_PER_TURN and len(first_turns) >= 4


def test_a_reader_behind_takes_everything_delivered_as_one_batch() -> None:
    async def run() -> list[list[int]]:
        stream = RequestStream("r", 1, {})
        batches: list[list[int]] = []

        async def read() -> None:
            async for batch in stream.batches():
                batches.append([delta.num_output_tokens for delta in batch])
                await asyncio.sleep(0.05)  # a slow writer: the next steps pile up meanwhile

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)
        await asyncio.to_thread(deliver, [(stream, _delta(1, False))])
        await asyncio.sleep(0.01)  # the reader took the first step and is writing it
        for k in (2, 3, 4):
            await asyncio.to_thread(deliver, [(stream, _delta(k, k == 4))])
        await reader
        return batches

    assert asyncio.run(run()) == [[1], [2, 3, 4]]


def test_a_reader_that_writes_only_text_is_woken_by_text_or_the_end() -> None:
    async def run() -> list[list[tuple[int, str]]]:
        stream = RequestStream("r", 1, {})
        stream.wake_on_text = True
        batches: list[list[tuple[int, str]]] = []

        async def read() -> None:
            async for batch in stream.batches():
                batches.append([(delta.num_output_tokens, delta.text) for delta in batch])

        reader = asyncio.create_task(read())
        await asyncio.sleep(0)
        for k, text in ((1, ""), (2, ""), (3, "é"), (4, ""), (5, "")):  # pieces of a character carry no text
            delta = StreamDelta(text, [k], [], k == 5, "length" if k == 5 else None, 1, k, 0.0)
            await asyncio.to_thread(deliver, [(stream, delta)])
            await asyncio.sleep(0.01)  # each its own turn: only text and the end wake the reader
        await reader
        return batches

    assert asyncio.run(run()) == [[(1, ""), (2, ""), (3, "é")], [(4, ""), (5, "")]]
