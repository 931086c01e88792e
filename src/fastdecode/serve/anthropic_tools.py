"""Tool use on /v1/messages, mapped onto the chat tool machinery (serve/tools.py, tool_calls.py).

* ``tools``: custom tools ``{"name", "description", "input_schema"}`` (server tools such as
  ``web_search_20250305`` are a 400 naming them); ``tool_choice``: ``{"type": "auto" | "any" |
  "tool" | "none", "name", "disable_parallel_tool_use"}``;
* content blocks: the assistant's ``tool_use`` (``id``, ``name``, ``input``) and the user's
  ``tool_result`` (``tool_use_id``, ``content`` text) become the chat's tool calls and tool messages;
* the answer: its calls as ``tool_use`` blocks, ``stop_reason: "tool_use"``."""

from __future__ import annotations

import json
from typing import Any

from .adapters import text_of
from .protocol import APIError
from .tool_calls import parse_tool_calls

CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of custom tools", param="tools")
    chat_tools = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{index}]: only custom tools ({{name, description, input_schema}}) are "
                                f"supported, not {kind!r}", param=f"tools[{index}]")
        function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        chat_tools.append({"type": "function", "function": function})
    fields: dict[str, Any] = {"tools": chat_tools}
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in (*CHOICES, "tool"):
            raise APIError(400, "tool_choice must be {'type': 'auto' | 'any' | 'tool' | 'none'}", param="tool_choice")
        fields["tool_choice"] = (CHOICES[choice["type"]] if choice["type"] != "tool"
                                 else {"type": "function", "function": {"name": choice.get("name")}})
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    return fields


def block_messages(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message -> its chat messages: text (and the assistant's tool_use blocks as calls),
    or the user's tool_result blocks as tool messages (text after them as a user message)."""
    if not isinstance(content, list):
        return [{"role": role, "content": text_of(content, where, ("text",))}]
    texts, calls, results = [], [], []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}[{index}]"
        if kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise APIError(400, f"{at}: a tool_use block needs id and name", param=at)
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise APIError(400, f"{at}: a tool_result block needs tool_use_id", param=at)
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                            "content": text_of(block.get("content", ""), f"{at}.content", ("text",))})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        else:
            raise APIError(400, f"{at}: {kind!r} blocks are not supported here (text, and tool_use from the "
                                "assistant / tool_result from the user)", param=at)
    text = "".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, "tool_calls": calls} if calls
                else {"role": "assistant", "content": text}]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def tool_use_blocks(text: str, tools: Any) -> tuple[str, list[dict[str, Any]]]:
    """The generated text -> (its text, the calls as tool_use blocks)."""
    if tools is None or not tools.parses_output:
        return text, []
    content, calls = parse_tool_calls(text, tools.names)
    blocks = [{"type": "tool_use", "id": tool_use_id(call["id"]), "name": call["function"]["name"],
               "input": json.loads(call["function"]["arguments"])} for call in calls]
    return (content or "", blocks) if blocks else (text, [])


def tool_use_id(call_id: str) -> str:
    """A chat call id ("call_...") as Anthropic spells a tool_use id ("toolu_...")."""
    return "toolu_" + call_id.removeprefix("call_")
