"""The OpenAI completions and chat APIs over an engine client: requests in, JSON or SSE out.

Everything here runs on the HTTP event loop and never waits on a forward pass: it submits, and
awaits the deltas the engine worker pushes. Parsing and validating bodies, tokenizing, chat
templating run in a small thread pool, and output constraints compile in another (the tokenizer
and llguidance release the GIL), so a large or slow request delays only itself. A request
is aborted in the engine as soon as its client is gone, streamed or not, so its KV blocks free
at once.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from jinja2 import TemplateError
from pydantic import BaseModel

from roseinfer.chat_template import template_variables
from roseinfer.engine.structured_output import JSON_WHITESPACE, CompiledGrammar, compile_pool
from roseinfer.pooling_params import PoolingParams
from roseinfer.sampling_params import SamplingParams
from roseinfer.output_processor import StreamDelta
from roseinfer.engine_client.client import EngineClient, OverloadedError, ShuttingDownError
from roseinfer.engine_client.request_stream import RequestStream
from roseinfer.server.logprobs import LogprobsFormatter
from roseinfer.server.protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingRequest, error_body
from roseinfer.reasoning import Reasoner, after_reasoning, pick_reasoning_parser
from roseinfer.server.request_body import BodyLimits, parse_body
from roseinfer.server.request_params import (bad_value, check_chat_fields, check_completion_fields, check_request,
                                             sampling_params)
from roseinfer.server.responses import (Choice, EventStream, Reply, prompt_entries, sse, wait_disconnect,
                                        without_output)
from roseinfer.server.structured import Constraint, ConstraintLimits, compile_constraint, requested_constraint
from roseinfer.server.tool_calls import chat_inputs, pick_parser, plan_tools, takes_system_role
from roseinfer.server.reply_parts import finish_reason, split_delta, split_reply
from roseinfer.server.tool_parsers import ToolParser

if TYPE_CHECKING:  # Ray is imported only when replicas are asked for
    from roseinfer.server.replicas import ReplicaSet

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by anyone
RETRY_AFTER_S = "1"
TOKENIZER_THREADS = 2  # the machine's cores go to the engine; a queue of long prompts waits here
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class OpenAIServing:
    def __init__(self, manager: EngineClient | ReplicaSet, model_name: str, max_sequences_per_request: int,
                 tool_call_parser: str, constraint_limits: ConstraintLimits, reasoning_parser: str) -> None:
        engine = manager.engine
        self.manager = manager
        self.model_name = model_name
        self.max_sequences = max_sequences_per_request
        self.body_limits = BodyLimits(max_sequences_per_request, engine.max_model_len)
        self.constraint_limits = constraint_limits
        self.tokenizer = engine.tokenizer
        self.defaults = engine.sampling_defaults  # the model's generation config, for fields a request leaves unset
        self.logprobs = LogprobsFormatter(engine.tokenizer)
        # what one request can hold: the context, or the whole KV pool if that is smaller
        self.context_limit = min(engine.max_model_len, engine.num_kv_blocks * engine.config.block_size)
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="roseinfer-tokenize")
        self._compile_pool = compile_pool()
        template = engine.tokenizer.chat_template
        self.tool_parser = pick_parser(template, tool_call_parser)
        self.think_tags = pick_reasoning_parser(template, reasoning_parser, engine.tokenizer)
        try:  # templates that never read `tools` get them as a system prompt (server/tool_calls.py)
            self.template_reads_tools = bool(template) and "tools" in template_variables(template)
        except TemplateError:  # a broken template fails each chat request with a 400 instead
            self.template_reads_tools = False
        self.template_takes_system = takes_system_role(engine.tokenizer) if template else True

    # ---- endpoints ---------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        start = time.perf_counter()
        self.check_model(body.model)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be >= 1 (0 only with echo, for the prompt alone)", "max_tokens")
        # echo with logprobs: the prompt tokens' logprobs come first, as OpenAI's legacy API gave
        # them (lm-evaluation-harness scores continuations so); max_tokens 0 then returns only
        # the prompt: one token is generated and dropped, as vLLM does
        echo_logprobs = body.echo and body.logprobs is not None
        prompt_only = body.echo and body.max_tokens == 0
        prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0) if echo_logprobs else body.prompt_logprobs
        texts = [body.prompt] if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else body.prompt
        check_request(body, len(texts), self.max_sequences, self.manager.max_inflight_requests)
        check_completion_fields(body)
        constraint = await self.run_blocking(requested_constraint, body, self.constraint_limits.max_bytes)
        grammar = await self.compile_constraint(constraint)
        prompts = [(await self.run_blocking(self.tokenizer.encode, p), p) if isinstance(p, str) else (list(p), None)
                   for p in texts]
        max_tokens = self.defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS) if body.max_tokens is None \
            else body.max_tokens
        params = sampling_params(body, self.defaults, 1 if prompt_only else max_tokens, body.logprobs, prompt_logprobs,
                                 constraint.params if constraint else None)
        streams = self.submit([ids for ids, _ in prompts], body, params, start, grammar)
        echoes = [(text if text is not None else self.tokenizer.decode(ids)) if body.echo else ""
                  for ids, text in prompts for _ in range(body.n)]
        prompt_ids = [ids if echo_logprobs else [] for ids, _ in prompts for _ in range(body.n)]
        reply = Reply(f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, "text_completion",
                      [len(ids) for ids, _ in prompts], body.include_usage, body.continuous_usage)
        if body.stream:
            for stream in streams:  # a chunk needs text, or the prompt echoed, or logprobs
                stream.wake_on_text = body.logprobs is None and not body.echo
            return EventStream(self._stream_completion(streams, reply, echoes, prompt_ids, body.logprobs, prompt_only),
                               lambda: self.abort_unfinished(streams))
        choices = await self.collect(streams, raw, prompt_only)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        out = []
        for i, c in enumerate(choices):
            choice = {"index": i, "text": echoes[i] + c.text, "finish_reason": c.finish_reason, "logprobs": None}
            if body.logprobs is not None:
                entries = prompt_entries(prompt_ids[i], c.prompt_logprobs) + [(lp.token_id, lp) for lp in c.logprobs]
                choice["logprobs"] = self.logprobs.completion(entries, 0, body.logprobs)
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.logprobs.prompt(c.prompt_logprobs or [], body.prompt_logprobs)
            out.append(choice)
        return JSONResponse(reply.body(out, choices))

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        start = time.perf_counter()
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
        check_request(body, 1, self.max_sequences, self.manager.max_inflight_requests)
        check_chat_fields(body)
        # in the pool: a schema or tools' parameters may be large to copy or parse
        constraint = await self.run_blocking(requested_constraint, body, self.constraint_limits.max_bytes)
        tools = await self.run_blocking(plan_tools, body, self.tool_parser, constraint is not None)
        constraint = constraint or tools.constraint
        ids = await self.chat_prompt(body.messages, tools.shown, body.chat_template_kwargs)
        reasoners = [self.reasoning_parser(ids) for _ in range(body.n)]
        constraint = self.answer_constraint(ids, constraint)
        grammar = await self.compile_constraint(constraint)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's chat default: whatever room the context has left
            max_tokens = min(max(1, self.context_limit - len(ids)), self.defaults.get("max_tokens", self.context_limit))
        params = sampling_params(body, self.defaults, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                                 body.prompt_logprobs, constraint.params if constraint else None)
        streams = self.submit([ids], body, params, start, grammar)
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model_name, "chat.completion",
                      [len(ids)], body.include_usage, body.continuous_usage,
                      reasoning_tokens={} if self.think_tags else None)
        parsers = [tools.parser() if tools.parser else None for _ in streams]
        if body.stream:
            for stream, parser, reasoner in zip(streams, parsers, reasoners):  # parsers may act on ids alone
                stream.wake_on_text = not body.logprobs and parser is None and reasoner is None
            return EventStream(self._stream_chat(streams, reply, body.logprobs, parsers, reasoners),
                               lambda: self.abort_unfinished(streams))
        choices = await self.collect(streams, raw)
        if choices is None:
            return Response(status_code=CLIENT_CLOSED)
        out = []
        for i, (c, parser, reasoner) in enumerate(zip(choices, parsers, reasoners)):
            reasoning, content, calls = split_reply(c.text, c.token_ids, reasoner, parser)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoner is not None:
                message["reasoning_content"] = message["reasoning"] = reasoning
                reply.reasoning_tokens[i] = reasoner.reasoning_tokens
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            out.append({"index": i, "message": message, "finish_reason": finish_reason(c.finish_reason, parser),
                        "logprobs": self.logprobs.chat(c.logprobs) if body.logprobs else None})
        response = reply.body(out, choices)
        if body.prompt_logprobs is not None:  # vLLM's: one prompt, so once per response
            response["prompt_logprobs"] = self.logprobs.prompt(choices[0].prompt_logprobs or [], body.prompt_logprobs)
        return JSONResponse(response)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")

    async def chat_prompt(self, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's prompt ids, with `tools` shown to the model (server/tool_calls.py) and
        the request's chat_template_kwargs as template variables."""
        def render() -> list[int]:  # in the pool: messages are copied, tool-call arguments parsed
            rendered, variables = chat_inputs(messages, tools, self.tool_parser, self.template_reads_tools,
                                              self.template_takes_system)
            return self.tokenizer.apply_chat_template(rendered, **{**(template_kwargs or {}), **variables})

        try:
            return await self.run_blocking(render)
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"could not apply the chat template: {exc}", "messages") from None

    def reasoning_parser(self, prompt_ids: list[int]) -> Reasoner | None:
        return self.think_tags.parser(prompt_ids, self.tokenizer) if self.think_tags is not None else None

    def answer_constraint(self, prompt_ids: list[int], constraint: Constraint | None) -> Constraint | None:
        """The output constraint, put after the reasoning when the reply starts with it (a 400
        where that cannot be done yet)."""
        reasoner = self.reasoning_parser(prompt_ids) if constraint is not None else None
        if reasoner is None or reasoner.mode == "content":
            return constraint
        try:
            params = after_reasoning(constraint.params, reasoner.tags, reasoner.mode, JSON_WHITESPACE)
        except ValueError as exc:
            raise APIError(400, f"{constraint.field}: {exc} (this model's reply starts with reasoning, --reasoning-"
                                f"parser {reasoner.tags.kind}): turn thinking off (chat_template_kwargs "
                                '{"enable_thinking": false} where the template reads it)', constraint.field) from None
        return Constraint(params, constraint.field)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run tokenizer work off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, model: type[M], raw: Request) -> M:
        """The request's body as `model`, parsed, counted and validated off the event loop (request_body.py)."""
        return await self.run_blocking(parse_body, model, await raw.body(), self.body_limits)

    async def compile_constraint(self, constraint: Constraint | None) -> CompiledGrammar | None:
        if constraint is None:
            return None
        return await compile_constraint(constraint, self.manager.engine, self._compile_pool, self.constraint_limits)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    # ---- request -> engine -------------------------------------------------------------------
    def submit(self, prompts: list[list[int]], body: SamplingRequest, params: SamplingParams,
               start: float, grammar: CompiledGrammar | None,
               pooling_params: PoolingParams | None = None) -> list[RequestStream]:
        """n engine requests per prompt; with a seed, choice i draws from seed + i; with
        `pooling_params`, embedding requests."""
        base_id = uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            for ids in prompts:
                for i in range(body.n):
                    choice_params = params if params.seed is None or i == 0 else \
                        dataclasses.replace(params, seed=params.seed + i)
                    streams.append(self.manager.submit(ids, choice_params, f"{base_id}-{len(streams)}", start, grammar,
                                                       pooling_params))
        except BaseException as exc:
            for stream in streams:  # all or nothing: no half-submitted choice sets
                self.manager.abort(stream.request_id)
            if isinstance(exc, OverloadedError):
                raise APIError(429, str(exc), code="rate_limit_exceeded", headers={"Retry-After": RETRY_AFTER_S}) from None
            if isinstance(exc, ShuttingDownError):
                raise APIError(503, str(exc)) from None
            if isinstance(exc, ValueError):
                raise bad_value(exc, body) from None
            raise
        return streams

    # ---- engine -> response ------------------------------------------------------------------
    async def _stream_completion(self, streams: list[RequestStream], reply: Reply, echoes: list[str],
                                 prompt_ids: list[list[int]], num_logprobs: int | None,
                                 prompt_only: bool) -> AsyncIterator[bytes]:
        """The first chunk of each choice carries the echoed prompt (and its tokens' logprobs)."""
        offsets = [0] * len(echoes)  # text_offset of the next token, per choice
        echoed = [False] * len(echoes)
        async for batch in self.merge_streams(streams):
            events = []
            for index, delta in batch:
                if prompt_only:
                    delta = without_output(delta)
                text, entries = delta.text, [(lp.token_id, lp) for lp in delta.logprobs]
                if not echoed[index]:
                    text, echoed[index] = echoes[index] + text, True
                    entries = prompt_entries(prompt_ids[index], delta.prompt_logprobs) + entries
                logprobs = self.logprobs.completion(entries, offsets[index], num_logprobs) \
                    if num_logprobs is not None else None
                if logprobs is not None and logprobs["tokens"]:
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                reply.record(index, delta)
                if delta.error:
                    events.append(sse(error_body(delta.error_status, delta.error)))
                elif text or delta.finished or (logprobs is not None and logprobs["tokens"]):
                    events.append(reply.chunk({"index": index, "text": text, "logprobs": logprobs,
                                               "finish_reason": delta.finish_reason}))
            if events:  # what a batch made, one write
                yield b"".join(events)
        yield b"".join(reply.tail())

    async def _stream_chat(self, streams: list[RequestStream], reply: Reply, want_logprobs: bool,
                           parsers: list[ToolParser | None],
                           reasoners: list[Reasoner | None]) -> AsyncIterator[bytes]:
        """Content as it comes, after the reasoning (delta.reasoning_content and delta.reasoning)
        when a reasoning parser splits it off; with a tool parser, each call in OpenAI's
        delta.tool_calls chunks (its id and name first, then its arguments), one chunk per entry."""
        # OpenAI's first chunk per choice names the role
        yield b"".join(reply.chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None}) for index in range(len(streams)))
        async for batch in self.merge_streams(streams):
            events = []
            for index, delta in batch:
                reply.record(index, delta)
                if delta.error:
                    events.append(sse(error_body(delta.error_status, delta.error)))
                    continue
                logprobs = self.logprobs.chat(delta.logprobs) if want_logprobs and delta.logprobs else None
                parser, reasoner = parsers[index], reasoners[index]
                reasoning, content, calls = split_delta(delta, reasoner, parser)
                if reasoner is not None:
                    reply.reasoning_tokens[index] = reasoner.reasoning_tokens
                parts = ([{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []) + \
                    ([{"content": content}] if content else []) + [{"tool_calls": [call]} for call in calls]
                if not parts and (delta.finished or logprobs):
                    parts = [{}]
                for i, part in enumerate(parts):  # logprobs with the first, the finish reason with the last
                    last = i == len(parts) - 1
                    events.append(reply.chunk({"index": index, "delta": part, "logprobs": None if i else logprobs,
                                               "finish_reason": finish_reason(delta.finish_reason, parser) if last
                                               else None}))
            if events:  # what a batch made, one write
                yield b"".join(events)
        yield b"".join(reply.tail())

    async def merge_streams(self, streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, StreamDelta]]]:
        """(choice index, delta) pairs from all streams as they come, in batches: everything that
        arrived since the caller last took."""
        tasks: list[asyncio.Task] = []
        try:
            if len(streams) == 1:
                async for deltas in streams[0].batches():
                    yield [(0, delta) for delta in deltas]
                return
            merged: asyncio.Queue[list[tuple[int, StreamDelta]]] = asyncio.Queue()

            async def pump(index: int, stream: RequestStream) -> None:
                async for deltas in stream.batches():
                    merged.put_nowait([(index, delta) for delta in deltas])

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            remaining = len(streams)
            while remaining:
                batch = await merged.get()
                while not merged.empty():
                    batch += merged.get_nowait()
                remaining -= sum(delta.finished for _, delta in batch)
                yield batch
        finally:
            for task in tasks:
                task.cancel()

    async def collect(self, streams: list[RequestStream], raw: Request,
                       prompt_only: bool = False) -> list[Choice] | None:
        """Run a non-streaming request to the end; None if the client went away first."""
        choices = [Choice() for _ in streams]

        async def gather() -> None:
            async for batch in self.merge_streams(streams):
                for index, delta in batch:
                    choices[index].add(without_output(delta) if prompt_only else delta)

        work = asyncio.ensure_future(gather())
        watch = asyncio.ensure_future(wait_disconnect(raw))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when this handler is cancelled (server shutdown)
            watch.cancel()
            work.cancel()
            self.abort_unfinished(streams)
        if work not in done:
            return None
        work.result()  # a bug in gather surfaces as a 500, not as a silent disconnect
        return choices

    async def collect_one(self, stream: RequestStream, raw: Request) -> Choice | None:
        """One choice run to the end (collect's None if the client went away); its error as an APIError."""
        choices = await self.collect([stream], raw)
        if choices is not None and choices[0].error:
            raise APIError(choices[0].error_status, choices[0].error)
        return None if choices is None else choices[0]

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        for stream in streams:
            if not stream.finished:
                self.manager.abort(stream.request_id)

