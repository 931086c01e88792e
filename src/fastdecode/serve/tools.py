"""OpenAI tool calling: the ``tools`` / ``tool_choice`` fields, the prompt, the grammar that enforces a call.

- The prompt: a chat template that knows tools (it mentions ``tools``, as Qwen2.5's and Hermes'
  do) is rendered with them, as transformers does; for any other template the tools go into a
  system message in the **generic format** (``GENERIC_TOOL_PROMPT``): the model is shown each
  function's JSON schema and answers a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (Hermes' format, which the Qwen2.5 family and most tool templates use too), so one parser
  reads both (``tool_calls.py``).
- ``tool_choice``: "none" (no tools in the prompt, plain text), "auto" (the model chooses; its
  output is parsed), "required" or a named function: the output is constrained by a Lark grammar
  to one or more (``parallel_tool_calls``) ``<tool_call>`` blocks whose JSON is
  ``{"name": <a tool>, "arguments": <that tool's parameters schema>}``.
- History: assistant messages with ``tool_calls`` (content null) and ``role: "tool"`` results are
  rendered natively by tool templates, and for the generic format as the same ``<tool_call>``
  text and a user message holding ``<tool_response>...</tool_response>``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..constraints.forms import closed_objects, lark_string
from .protocol import APIError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# Compact JSON inside the calls (see constraints/forms.py): a small model cannot pad it with whitespace.
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GENERIC_TOOL_PROMPT = (
    "You can call functions. The available functions, as JSON schemas:\n{tools}\n"
    "To call a function, answer only with one line per call, each exactly like:\n"
    '<tool_call>{{"name": "<function name>", "arguments": {{<the arguments as JSON>}}}}</tool_call>\n'
    "Otherwise answer the user normally."
)


@dataclass
class ToolRequest:
    """The validated tool fields of a chat request."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # {"name", "description", "parameters"}
    choice: str = "auto"  # "none" | "auto" | "required" | "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"

    @property
    def names(self) -> list[str]:
        return [tool["name"] for tool in self.tools]

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates expect them (transformers passes OpenAI's form)."""
        return [{"type": "function", "function": tool} for tool in self.tools]


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice``, ``parallel_tool_calls`` -> a ToolRequest (None without tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} function tools", param="tools")
    request = ToolRequest(tools=[_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)])
    if len(set(request.names)) != len(request.names):
        raise APIError(400, "tools has two functions with the same name", param="tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(400, "parallel_tool_calls must be true or false", param="parallel_tool_calls")
    request.parallel = parallel
    if choice is None or choice in ("none", "auto", "required"):
        request.choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in request.names:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools "
                                f"({', '.join(request.names)})", param="tool_choice")
        request.choice, request.named = "named", name
    else:
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', param="tool_choice")
    return request


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise APIError(400, f'{where} must be {{"type": "function", "function": {{"name", "parameters"}}}}',
                       param=where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise APIError(400, f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                       param=f"{where}.function.name")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise APIError(400, f"{where}.function.parameters must be a JSON schema object",
                       param=f"{where}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.function.description must be a string", param=f"{where}.function.description")
    out = {"name": name, "parameters": parameters}
    if description:
        out["description"] = description
    return out


def tool_grammar(request: ToolRequest) -> dict | None:
    """The grammar form enforcing a call for "required" / a named function, else None."""
    if request.choice not in ("required", "named"):
        return None
    tools = [t for t in request.tools if request.choice == "required" or t["name"] == request.named]
    rules = [f"f{index}: %json {json.dumps(call_schema(tool))}" for index, tool in enumerate(tools)]
    calls = " | ".join(f"f{index}" for index in range(len(tools)))
    several = request.parallel and request.choice == "required"  # a named function: one call, as OpenAI
    start = f"start: call ({lark_string(chr(10))} call)*" if several else "start: call"
    lines = [start, f"call: {lark_string('<tool_call>')} ({calls}) {lark_string('</tool_call>')}", *rules]
    return {"type": "grammar", "grammar": "\n".join(lines) + "\n"}


def call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call of ``tool``: its name and arguments valid against its parameters."""
    arguments = closed_objects(tool["parameters"])  # only the named arguments (constraints/forms.py)
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": CALL_JSON_STYLE}


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def render_messages(messages: list[dict[str, Any]], request: ToolRequest | None,
                    template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """-> (messages for the chat template, extra template variables). Tool history is kept for a
    template that knows tools and rewritten to the generic format's text otherwise."""
    native = template_knows_tools(template)
    offered = request is not None and request.choice != "none"
    out = []
    for message in messages:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if native:
            if calls:
                message["tool_calls"] = [{"type": "function", "id": c["id"], "function": {
                    "name": c["function"]["name"], "arguments": _arguments_object(c["function"]["arguments"])}}
                    for c in calls]
        elif message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        elif calls:
            text = "\n".join(call_text(c["function"]["name"], _arguments_object(c["function"]["arguments"]))
                             for c in calls)
            message = {"role": message["role"], "content": (message["content"] + "\n" + text).strip()}
        if not native:
            message.pop("tool_call_id", None)
        out.append(message)
    if not offered:
        return out, {}
    if native:
        return out, {"tools": request.openai_tools()}
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in request.tools)
    prompt = GENERIC_TOOL_PROMPT.format(tools=listing)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def call_text(name: str, arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "</tool_call>"


def _arguments_object(arguments: Any) -> Any:
    """A history call's arguments (OpenAI sends a JSON string) as the object templates print."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
