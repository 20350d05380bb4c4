"""roseinfer serve | generate | chat | bench."""
from __future__ import annotations

import argparse
import json
import sys
import time

from roseinfer.engine_args import add_engine_args, engine_config_from_args


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--seed", type=int, default=None, help="sampling seed (reproducible sampled output)")
    group.add_argument("--structured-outputs", metavar="JSON", default=None,
                       help='constrain the output, e.g. \'{"json": SCHEMA}\', \'{"regex": "[0-9]+"}\', '
                            '\'{"choice": ["yes", "no"]}\', \'{"grammar": LARK}\' or \'{"json_object": true}\'')
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="end the output where this text first appears (cut before it); repeatable")
    group.add_argument("--no-chat-template", action="store_true",
                       help="send the prompt as is instead of wrapping it in the model's chat template")


def _sampling_params(args: argparse.Namespace):
    from roseinfer import SamplingParams, StructuredOutputsParams

    constraint = None
    if args.structured_outputs is not None:
        try:
            spec = json.loads(args.structured_outputs)
        except ValueError as exc:
            raise ValueError(f"--structured-outputs is not valid JSON: {exc}") from None
        if not isinstance(spec, dict):
            raise ValueError("--structured-outputs must be a JSON object such as '{\"regex\": \"[0-9]+\"}'")
        try:
            constraint = StructuredOutputsParams(**spec)
        except TypeError as exc:  # an unknown key
            raise ValueError(f"--structured-outputs: {exc}") from None
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=args.stop, structured_outputs=constraint)


def _prompt_ids(llm, text: str, use_template: bool, history: list[dict] | None = None) -> list[int]:
    if use_template and llm.tokenizer.has_chat_template:
        return llm.apply_chat_template((history or []) + [{"role": "user", "content": text}])
    return llm.tokenizer.encode(text)


def cmd_generate(args: argparse.Namespace) -> int:
    from roseinfer import LLM

    start = time.perf_counter()
    llm = LLM(**vars(engine_config_from_args(args, seed=0)))
    loaded = time.perf_counter()
    out = llm.generate([_prompt_ids(llm, args.prompt, not args.no_chat_template)], _sampling_params(args),
                       use_tqdm=False)[0]
    print(out.text)
    print(f"[load {loaded - start:.2f}s, generate {time.perf_counter() - loaded:.2f}s, "
          f"{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from roseinfer import LLM
    from roseinfer.output_processor import OutputProcessor

    llm = LLM(**vars(engine_config_from_args(args, seed=0)))
    engine = llm.engine
    history: list[dict] = []
    print("roseinfer chat: type a message, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not text.strip():
            continue
        ids = _prompt_ids(llm, text, not args.no_chat_template, history)
        params = _sampling_params(args)
        request = engine.new_request(ids, params)
        engine.core.add(request)
        processor = OutputProcessor(llm.tokenizer)
        processor.add_request(request.request_id, ids, params)
        reply: list[str] = []
        finish_reason = None

        def show(outputs: list) -> None:
            nonlocal finish_reason
            processed = processor.process(outputs, time.perf_counter())
            for request_id in processed.stopped_ids:
                engine.abort_request(request_id)
            for _, delta in processed.deltas:
                print(delta.text, end="", flush=True)
                reply.append(delta.text)
                finish_reason = delta.finish_reason

        try:
            while processor.has_requests():
                show(engine.step())
        except KeyboardInterrupt:
            aborted = engine.abort_request(request.request_id)
            show([aborted] if aborted is not None else [])
        engine.pop_finished_ids()
        print()
        if finish_reason == "length":  # a cut reply must not pass for a whole one
            print(f"[reply cut at --max-tokens {args.max_tokens}]", file=sys.stderr)
        history += [{"role": "user", "content": text}, {"role": "assistant", "content": "".join(reply)}]


def cmd_serve(args: argparse.Namespace) -> int:
    from roseinfer.server.app import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="roseinfer", description="A small, fast LLM inference engine with an OpenAI-compatible server.",
        epilog="Run `roseinfer COMMAND --help` for a command's flags. With no --model, the embedded "
               "SmolLM2-135M-Instruct is used.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="complete one prompt and print the text",
                         description="Complete one prompt (chat template applied by default) and print the text.")
    gen.add_argument("prompt")
    _sampling_args(gen)
    add_engine_args(gen, skip=("seed",))
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come",
                          description="Interactive chat with the model; tokens stream as they are produced.")
    _sampling_args(chat)
    add_engine_args(chat, skip=("seed",))
    chat.set_defaults(func=cmd_chat)

    from roseinfer.server.args import add_server_args

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                           description="Serve the OpenAI completions and chat APIs over HTTP (SSE streaming).")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from roseinfer.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:
        # bad input and unreadable models end with one line, not a traceback
        print(f"roseinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
