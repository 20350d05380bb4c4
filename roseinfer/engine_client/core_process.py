"""The engine process: EngineCore's loop alone (schedule -> execute -> update), fed new requests and
aborts by its client over ZMQ, each turn's outputs sent back as one message. No text, no HTTP:
detokenization and stop strings stay with the client (engine_client/process_client.py).

It exits when its client's end of the pipe closes (the client shut it down, or died), and never on
SIGINT: a Ctrl-C reaches the whole process group, and the server drains first, then stops it."""
from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from concurrent.futures import Future
from multiprocessing.connection import Connection

import zmq

from roseinfer.config import EngineConfig
from roseinfer.engine.llm_engine import LLMEngine
from roseinfer.engine.outputs import EngineCoreOutput
from roseinfer.engine.structured_output import CompiledGrammar, compile_pool
from roseinfer.engine_client.in_process import engine_stats
from roseinfer.engine_client.messages import (ABORT, ADD, RESET_PREFIX_CACHE, AddRequest, CoreOutputs, add_decoder, encoder,
                                              ids_decoder)

logger = logging.getLogger(__name__)


def run_engine_core(config: EngineConfig, inbox_address: str, outbox_address: str, client: Connection) -> None:
    """The process's target: build the engine, report its limits (or why it could not start) on
    `client`, then loop until stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 -- the client re-raises it
        client.send(("failed", exc))
        return
    gc.freeze()  # the built engine lives as long as the process: no full collection walks it again
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.bind(inbox_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never block a step on a slow reader
    outbox.connect(outbox_address)
    try:
        client.send(("ready", {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.num_kv_blocks,
                               "stats": engine_stats(engine)}))
        # stepped on a thread of its own, as the in-process client steps it: the main thread's OpenMP
        # team spins while other processes hold the cores (docs/profiling.md, section 5)
        loop = threading.Thread(target=CoreLoop(engine, inbox, outbox, client).run, name="roseinfer-engine-core")
        loop.start()
        loop.join()
    finally:
        engine.shutdown()
        context.destroy(linger=0)


class CoreLoop:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, client: Connection) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.client = client
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(client.fileno(), zmq.POLLIN)  # readable at EOF: the client is gone
        # constraints compile on threads of their own (llguidance drops the GIL), not in the step loop;
        # a finished compile writes a byte to `_compiled` to wake the loop's poll
        self._compile_pool = compile_pool()
        self._compiling: dict[str, tuple[AddRequest, Future[CompiledGrammar]]] = {}
        self._compiled, self._compiled_signal = os.pipe()
        self.poller.register(self._compiled, zmq.POLLIN)

    def run(self) -> None:
        engine = self.engine
        while True:
            events = dict(self.poller.poll(0 if engine.has_unfinished() else None))
            if self.client.fileno() in events:
                self._compile_pool.shutdown(wait=False, cancel_futures=True)
                return
            outputs: list[EngineCoreOutput] = []
            received = self._compiled in events
            if received:
                os.read(self._compiled, 4096)
                outputs += self._add_compiled()
            while True:
                try:
                    kind, body = self.inbox.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                received = True
                if kind == ADD:
                    outputs += self._add(body)
                elif kind == ABORT:
                    outputs += [out for out in map(self._abort, ids_decoder.decode(body)) if out is not None]
                elif kind == RESET_PREFIX_CACHE:
                    engine.block_manager.reset_prefix_cache()
            failure = None
            if engine.has_unfinished():
                try:
                    outputs += engine.step()
                except Exception as exc:  # noqa: BLE001 -- the loop outlives a bad step; its requests do not
                    logger.exception("engine step failed; failing the requests in flight")
                    failure = f"internal engine error: {type(exc).__name__}: {exc}"
                    self._abort_all()
            engine.pop_finished_ids()
            if outputs or failure or received:
                self.outbox.send(encoder.encode(CoreOutputs(outputs, engine_stats(self.engine), failure)))

    def _add(self, body: bytes) -> list[EngineCoreOutput]:
        """The request into the core, or, with a constraint, into the compile threads first; one that
        fails here (validated by the client, so rarely) ends at once with its reason."""
        add = add_decoder.decode(body)
        constraint = add.params.structured_outputs
        if constraint is None:
            return self._admit(add, None)
        compiling = self._compile_pool.submit(self.engine.compile_grammar, constraint)
        self._compiling[add.request_id] = add, compiling
        compiling.add_done_callback(lambda _: os.write(self._compiled_signal, b"\0"))
        return []

    def _add_compiled(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for request_id, (add, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[request_id]
                error = compiling.exception()
                outputs += self._admit(add, None, error) if error is not None else self._admit(add, compiling.result())
        return outputs

    def _admit(self, add: AddRequest, grammar: CompiledGrammar | None,
               error: BaseException | None = None) -> list[EngineCoreOutput]:
        try:
            if error is not None:
                raise error
            req = self.engine.new_request(add.prompt_ids, add.params, add.request_id, grammar,
                                          pooling_params=add.pooling_params)
            req.arrival_time = add.arrival
            self.engine.core.add(req)
        except Exception as exc:  # noqa: BLE001 -- one request's failure, reported on its stream
            logger.exception("could not add request %s", add.request_id)
            return [EngineCoreOutput(add.request_id, [], "abort", error=str(exc), num_prompt_tokens=len(add.prompt_ids))]
        return []

    def _abort(self, request_id: str) -> EngineCoreOutput | None:
        """As the engine's abort_request, for a request whose constraint still compiles too."""
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            return EngineCoreOutput(request_id, [], "abort", num_prompt_tokens=len(compiling[0].prompt_ids))
        return self.engine.abort_request(request_id)

    def _abort_all(self) -> None:
        """After a failed step: the client fails every open request on the failure message, those
        whose constraint still compiles included."""
        self._compiling.clear()
        for request_id in list(self.engine.core.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # noqa: BLE001 -- the engine is already in trouble; free what we can
                logger.exception("abort of %s failed", request_id)
