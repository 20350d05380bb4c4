"""Tools on /v1/chat/completions: what the prompt shows, what tool_choice constrains, and which
parser reads the output.

Templates that read `tools` (Qwen2.5, Hermes, Llama 3.1, ...) get them as transformers passes them
(OpenAI's shape), and the history's tool_calls and tool messages as they are. Templates that do not
(ChatML, as the default model's) get what llama.cpp gives generic templates: a system prompt that
lists the tools and the call format the parser reads (at the head of the first user message where
the template refuses a system role, as Gemma 2's does), earlier calls written out in that format,
and tool results as user messages.

tool_choice "auto" (the default with tools): free output, parsed. "none": the model calls no tool
(OpenAI): tools are not shown and the output is not parsed. "required": the output is constrained to
a JSON array of {"name", "parameters"} objects, each valid for its function (one at most when
parallel_tool_calls is false). A named function: the output is constrained to its parameters and
is the arguments of one call (vLLM's way for both).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from jinja2 import TemplateError

from roseinfer.server.protocol import APIError, ChatCompletionRequest, ChatMessage, Tool
from roseinfer.server.structured import Constraint, constraint
from roseinfer.server.tool_parsers import NamedCallParser, ToolParser, format_calls, make_parser

# what OpenAI means by a function without parameters: it takes none
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CALL_FORMATS = {
    "hermes": ("To call a function, answer with one block per call, in this form:\n<tool_call>\n"
               '{"name": "<function name>", "arguments": <its arguments as a JSON object>}\n</tool_call>'),
    "llama3_json": ('To call functions, answer with only the calls, as JSON objects separated by "; ", each in '
                    'this form:\n{"name": "<function name>", "parameters": <its arguments as a JSON object>}'),
}


def pick_parser(template: str | None, flag: str = "auto") -> str:
    """--tool-call-parser, or with "auto" the format the chat template shows its model."""
    if flag != "auto":
        return flag
    template = template or ""
    if "<|channel|>" in template:
        return "harmony"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"  # the format the generic prompt asks for


@dataclass
class ToolPlan:
    shown: list[dict[str, Any]] | None  # the tools as the prompt shows them
    constraint: Constraint | None  # tool_choice required or named
    parser: Callable[[], ToolParser] | None  # one per choice; None: the output is all content


def plan_tools(body: ChatCompletionRequest, parser_kind: str, output_constrained: bool) -> ToolPlan:
    """What this request's tools mean; `output_constrained`: response_format or the like is set."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None:
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice")
        return ToolPlan(None, None, None)
    tools = {tool.function.name: tool for tool in body.tools}
    if len(tools) < len(body.tools):
        raise APIError(400, "tools has two functions with the same name", "tools")
    if choice == "none":
        return ToolPlan(None, None, None)
    shown = shown_tools(body.tools)
    if choice in (None, "auto"):
        # the output follows response_format then, which has no room for calls
        parser = None if output_constrained else partial(make_parser, parser_kind,
                                                         None if body.parallel_tool_calls else 1)
        return ToolPlan(shown, None, parser)
    if output_constrained:
        raise APIError(400, "tool_choice required or named constrains the output, and so does response_format "
                            "(or structured_outputs / guided_*): give one", "tool_choice")
    if choice == "required":
        return ToolPlan(shown, constraint("tools", json=calls_schema(body.tools, body.parallel_tool_calls)),
                        partial(make_parser, "required"))
    name = choice.function.name
    if name not in tools:
        raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
    return ToolPlan(shown, constraint("tools", json=tools[name].function.parameters or NO_PARAMETERS),
                    partial(NamedCallParser, name))


def shown_tools(tools: list[Tool]) -> list[dict[str, Any]]:
    """Tools as templates take them: OpenAI's shape, as transformers passes them."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each {"name": its function, "parameters": valid for it}. Definitions
    the functions' schemas refer to ($defs) move to the top, where their "#/$defs/..." refs point."""
    shared: dict[str, dict[str, Any]] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        for key in ("$defs", "definitions"):
            if not isinstance(parameters.get(key), dict):
                continue
            for name, schema in parameters.pop(key).items():
                if shared.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise APIError(400, f"two functions define {key}/{name} differently; with tool_choice "
                                        "required their definitions must agree", "tools")
        variants.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                          "parameters": parameters},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, **shared}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def chat_inputs(messages: list[ChatMessage], shown: list[dict[str, Any]] | None, parser_kind: str,
                template_reads_tools: bool, template_takes_system: bool = True
                ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render the conversation with."""
    if template_reads_tools:
        return [m.to_template() for m in messages], ({"tools": shown} if shown else {})
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        rendered = message.to_template()
        if message.role == "tool":  # consecutive results make one user turn
            result = f"<tool_response>\n{message.text}\n</tool_response>"
            if i and messages[i - 1].role == "tool":
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            continue
        if message.tool_calls:
            calls = format_calls(parser_kind, [call["function"] for call in rendered.pop("tool_calls")])
            rendered["content"] = f"{rendered['content']}\n{calls}" if rendered["content"] else calls
        out.append(rendered)
    if shown:
        prompt = tools_prompt(parser_kind, shown)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        elif not template_takes_system and out and out[0]["role"] == "user":
            out[0] = {**out[0], "content": f"{prompt}\n\n{out[0]['content']}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def takes_system_role(tokenizer: Any) -> bool:
    """Whether the chat template renders a system message (Gemma 2's raises on one; Gemma 3's folds
    it into the first user turn): probed once, as llama.cpp probes a template's capabilities."""
    probe = "roseinfer-system-probe"
    try:
        text = tokenizer.render_chat_template([{"role": "system", "content": probe}, {"role": "user", "content": "hi"}])
    except (TemplateError, ValueError, TypeError):
        return False
    return probe in text


def tools_prompt(parser_kind: str, shown: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in shown)
    return f"You can call these functions (JSON schemas):\n<tools>\n{listing}\n</tools>\n{CALL_FORMATS[parser_kind]}"
