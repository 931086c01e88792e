"""Chat templates: chosen from a tokenizer config, compiled and rendered as ``transformers`` does.

Templates run in the sandbox configuration ``transformers`` uses (same options, globals and
filters), so prompts are byte-identical to ``apply_chat_template(tokenize=False)``.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, ClassVar

from ...errors import TokenizerError


def select_chat_template(value: Any, where: Any) -> str | None:
    """A template is a string, or a list of {name, template} / a dict name -> template: take 'default'."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        try:
            value = {entry["name"]: entry["template"] for entry in value}
        except (TypeError, KeyError) as exc:
            raise TokenizerError(f"{where}: chat_template list entries need 'name' and 'template'") from exc
    if isinstance(value, dict):
        template = value.get("default")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{where}: the 'default' chat template is not a string")
        return template
    raise TokenizerError(f"{where}: chat_template has unexpected type {type(value).__name__}")



def compile_chat_template(source: str) -> Any:
    """Compile a chat template in the sandbox transformers uses (same options, globals and filters)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (training-mask markers): render the body as is."""

        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise TokenizerError(f"chat template error: {message}")

    def tojson(
        value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        # Jinja's own tojson HTML-escapes (<, >, &, '); transformers' does not, and templates expect that.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"invalid chat template: {exc}") from exc


def render_chat_template(
    compiled: Any, messages: list[dict], add_generation_prompt: bool, token_strings: dict[str, str | None],
    extra: dict[str, Any],
) -> str:
    """Render like ``transformers``: the tokenizer's token strings and ``extra`` (``tools``,
    ``documents``, ``enable_thinking``...) are template variables beside ``messages``."""
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update({name: value for name, value in token_strings.items() if value is not None})
    variables.update(extra)
    variables["messages"] = [dict(m) for m in messages]
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        return compiled.render(**variables)
    except TokenizerError:
        raise
    except Exception as exc:  # jinja2 errors, or a template doing something invalid with the data
        raise TokenizerError(f"chat template failed to render: {type(exc).__name__}: {exc}") from exc
