"""Function tools on /v1/responses, mapped onto the chat tool machinery (serve/tools.py,
serve/tool_calls.py): the Responses forms in, the chat forms out, and back.

* ``tools``: ``[{"type": "function", "name", "description", "parameters", "strict"}]`` (built-in
  tools such as web search are a 400 naming them); ``tool_choice``: "none" | "auto" | "required" |
  ``{"type": "function", "name"}``; ``parallel_tool_calls``.
* input items ``function_call`` (``call_id``, ``name``, ``arguments``) and ``function_call_output``
  (``call_id``, ``output``): the assistant's earlier calls and their results.
* output: the generated calls as ``function_call`` items (``call_id``, ``name``, ``arguments``)."""

from __future__ import annotations

import uuid
from typing import Any

from .protocol import APIError
from .tool_calls import parse_tool_calls


def chat_tool_fields(body: dict[str, Any]) -> dict[str, Any]:
    tools = body.get("tools")
    if tools is None:
        if body.get("tool_choice") is not None:
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return {}
    if not isinstance(tools, list):
        raise APIError(400, "tools must be a list of function tools", param="tools")
    chat_tools = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise APIError(400, f"tools[{index}]: only function tools are supported, not {kind!r}",
                           param=f"tools[{index}]")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        chat_tools.append({"type": "function", "function": function})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name'}",
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fields = {"tools": chat_tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls")}
    return {name: value for name, value in fields.items() if value is not None}  # absent: the chat defaults


def tool_item_message(item: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A ``function_call`` / ``function_call_output`` input item -> its chat message; None for others."""
    kind = item.get("type")
    if kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise APIError(400, f"{where}: a function_call item needs call_id, name and arguments (strings)",
                           param=where)
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
            raise APIError(400, f"{where}: a function_call_output item needs call_id and output (strings)",
                           param=where)
        return {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
    return None


def merge_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive assistant call messages (one per function_call item) -> one message with every call."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        previous = merged[-1] if merged else None
        if (message.get("tool_calls") and previous is not None and previous.get("tool_calls")
                and previous.get("content") is None):
            previous["tool_calls"] = previous["tool_calls"] + message["tool_calls"]
        else:
            merged.append(dict(message))
    return merged


def split_calls(text: str, tools: Any) -> tuple[str, list[dict[str, Any]]]:
    """The generated text -> (its content, the calls as function_call output items)."""
    if tools is None or not tools.parses_output:
        return text, []
    content, calls = parse_tool_calls(text, tools.names)
    if not calls:
        return text, []
    items = [{"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
              "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}
             for call in calls]
    return content or "", items
