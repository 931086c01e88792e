"""The structured-output fields of a request body -> one ``response_format`` option, compiled off the
engine thread.

Accepted forms (one per request):
- OpenAI ``response_format``: ``{"type": "text" | "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}``;
- vLLM ``structured_outputs``: ``{"json": schema}``, ``{"regex": "..."}``, ``{"choice": [...]}``,
  ``{"grammar": "..."}`` (GBNF or Lark);
- llama.cpp: a top-level ``json_schema`` (the schema itself) or ``grammar`` (GBNF).
Every form becomes a dict form of ``fastdecode.constraints.forms``; the engine sees only that.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from ..constraints.forms import response_format_from
from ..errors import FastDecodeError
from .protocol import APIError, GenerationRequest
from .tools import parse_tools, tool_grammar

STRUCTURED_FIELDS = ("response_format", "structured_outputs", "json_schema", "grammar")
VLLM_KINDS = ("json", "regex", "choice", "grammar")


def attach_constraints(request: GenerationRequest, body: dict[str, Any]) -> None:
    """Set the request's ``response_format`` option (and ``tools``) from the body's structured-output
    and tool fields: a forced tool call ("required", a named function) is its grammar."""
    form, name = body_response_format(body)
    if request.endpoint == "chat":
        request.tools = parse_tools(body)
    elif body.get("tools") is not None:
        raise APIError(400, "tools are for /v1/chat/completions", param="tools")
    grammar = tool_grammar(request.tools) if request.tools is not None else None
    if grammar is not None:
        if form is not None:
            raise APIError(400, f"{name} cannot be combined with a forced tool call (tool_choice "
                                f"{request.tools.choice}): the call's own grammar constrains the output", param=name)
        form, name = grammar, "tools"
    if form is not None:
        request.options["response_format"] = form
        request.constraint_field = name


def body_response_format(body: dict[str, Any]) -> tuple[dict | None, str | None]:
    """-> (the dict form or None, the body field it came from). APIError naming the field."""
    given = [name for name in STRUCTURED_FIELDS if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, f"give only one of {', '.join(given)}: each sets the output's constraint",
                       param=given[1])
    if not given:
        return None, None
    name = given[0]
    value = body[name]
    if name == "response_format":
        form = value
    elif name == "structured_outputs":
        form = _vllm_form(value)
    elif name == "json_schema":
        if not isinstance(value, dict):
            raise APIError(400, "json_schema must be a JSON schema object", param=name)
        form = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": value}}
    else:
        form = {"type": "grammar", "grammar": value}
    try:
        return response_format_from(form, name), name
    except FastDecodeError as exc:
        raise APIError(400, str(exc), param=name) from exc


def _vllm_form(value: Any) -> dict:
    if not isinstance(value, dict):
        raise APIError(400, "structured_outputs must be an object with one of json, regex, choice, grammar",
                       param="structured_outputs")
    kinds = [kind for kind in VLLM_KINDS if value.get(kind) is not None]
    unsupported = sorted(set(value) - set(VLLM_KINDS) - {"disable_fallback", "disable_any_whitespace",
                                                           "disable_additional_properties", "whitespace_pattern"})
    if unsupported:
        raise APIError(400, f"structured_outputs.{unsupported[0]} is not supported (use one of "
                            f"{', '.join(VLLM_KINDS)})", param="structured_outputs")
    if len(kinds) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar",
                       param="structured_outputs")
    kind = kinds[0]
    if kind == "json":
        schema = value["json"]
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"structured_outputs.json is not valid JSON: {exc}",
                               param="structured_outputs") from exc
        return {"type": "json_schema", "json_schema": {"name": "structured_outputs", "schema": schema}}
    return {"type": kind, kind: value[kind]}


async def compile_off_thread(generator: Any, request: GenerationRequest) -> None:
    """Compile the request's constraint on a worker thread (llguidance's compiler drops the GIL), so
    that the engine thread finds it cached, and check every offered tool's parameters schema; an
    invalid schema or grammar is a 400 naming its field."""
    checks = []
    if request.options.get("response_format") is not None:
        checks.append((request.options["response_format"], request.constraint_field))
    if request.tools is not None and request.tools.choice == "auto":
        checks += [({"type": "json_schema", "json_schema": {"schema": tool["parameters"]}},
                    f"tools[{index}].function.parameters") for index, tool in enumerate(request.tools.tools)]
    if not checks:
        return

    def compile_all() -> None:
        for form, name in checks:
            try:
                generator.compile_constraint(form, name)
            except FastDecodeError as exc:
                raise APIError(400, str(exc), param=name, code="invalid_value") from exc

    await asyncio.get_running_loop().run_in_executor(None, compile_all)
