"""What travels between the engine process and its client, and how: msgpack through msgspec, whose
structs encode as arrays without field names (the choice against pickle is measured in
docs/profiling.md). Each message is two ZMQ frames: its kind, then its body."""
from __future__ import annotations

import msgspec

from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams

ADD = b"a"  # body: AddRequest
ABORT = b"x"  # body: a list of request ids
RESET_PREFIX_CACHE = b"r"  # no body


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # validated by the client; its grammar compiled again in the engine process
    arrival: float  # time.perf_counter() at submit: CLOCK_MONOTONIC, the same clock in both processes
    pooling_params: PoolingParams | None = None  # an embedding request


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """Everything one turn of the engine's loop produced: one message a step."""

    outputs: list[EngineCoreOutput]
    stats: dict[str, float]  # the engine's counters after this turn (/metrics)
    failure: str | None = None  # a step failed: the core ended every request it held with this reason


encoder = msgspec.msgpack.Encoder()
add_decoder = msgspec.msgpack.Decoder(AddRequest)
ids_decoder = msgspec.msgpack.Decoder(list[str])
outputs_decoder = msgspec.msgpack.Decoder(CoreOutputs)
