"""Chat templates: where a folder keeps its template, and rendering it the way transformers does
(sandboxed jinja2 with transformers' filters and globals) without importing transformers."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

# Names a message's reasoning may come under; transformers copies it to the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def pick_template(value: Any) -> str | None:
    """A template string, or the "default" one of several named templates (list or dict)."""
    if isinstance(value, list):
        value = {t["name"]: t["template"] for t in value}
    if isinstance(value, dict):
        value = value.get("default")
    return value if isinstance(value, str) and value else None


def template_source(folder: Path, cfg: dict[str, Any]) -> str | None:
    # As in transformers: template files (chat_template.jinja, which v5 saves, or the named ones
    # in additional_chat_templates/) take priority over tokenizer_config.json's chat_template.
    files = {p.stem: p for p in sorted((folder / "additional_chat_templates").glob("*.jinja"))}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = folder / "chat_template.jinja"
    if files:
        return files["default"].read_text(encoding="utf-8") if "default" in files else None
    return pick_template(cfg.get("chat_template"))


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to the template: keys whose value is None dropped
    (templates handle a missing key better than a literal None), reasoning under both names."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def compile_template(source: str) -> Any:
    """Compile a chat template in the environment transformers uses (jinja2 is imported only here)."""
    return _environment().from_string(source)


def template_variables(source: str) -> set[str]:
    """The variables a template reads from its caller (messages, tools, add_generation_prompt, ...)."""
    from jinja2 import meta

    return meta.find_undeclared_variables(_environment().parse(source))


def _environment() -> Any:
    """transformers' sandboxed environment, with its filters and globals."""
    import jinja2.ext
    import jinja2.nodes
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers'
        training masks; templates that use it must still compile, and it renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja2's own tojson escapes HTML characters; templates want plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # Templates come from the Hub, so they run sandboxed and cannot mutate their inputs.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
