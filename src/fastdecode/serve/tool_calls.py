"""Reading tool calls out of a finished choice's text, and writing them the OpenAI way.

The parser reads the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``),
which is also fastdecode's generic format (serve/tools.py). A block whose JSON does not parse or
names no offered function is left in the content. A choice with at least one call answers
``message.tool_calls`` (``id``, ``type``, ``function.name``, ``function.arguments`` as a JSON
string), the text before the first call as ``content`` (null if empty) and ``finish_reason``
"tool_calls". Streams send, per call, a delta with its index, id, type and name (arguments
""), then the arguments in fragments, as OpenAI does.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
ARGUMENT_FRAGMENT_CHARS = 16  # stream deltas carry the arguments in pieces of this many characters


OPEN = "<tool_call>"


def parse_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]], int]:
    """-> (the content: the text before the first call, None if blank; the OpenAI tool calls
    found; where the first call starts). No calls: (text, [], len(text))."""
    calls, first = [], len(text)
    for match in CALL_BLOCK.finditer(text):
        call = _call(match.group(1), names)
        if call is not None:
            first = min(first, match.start())
            calls.append(call)
    if not calls:
        return text, [], len(text)
    content = text[:first].strip()
    return content or None, calls, first


class ToolStream:
    """One streamed choice of a request with tools: content goes out as it comes until a call may be
    starting (text from a possible ``<tool_call>`` on is held), the calls at the end."""

    def __init__(self, names: list[str]):
        self.names = names
        self.sent = 0  # characters of the choice's text already sent as content
        self.holding = False

    def content(self, text: str) -> str:
        """The content that is safe to send now, given the choice's whole text so far."""
        if self.holding:
            return ""
        at = text.find(OPEN)
        if at >= 0:
            self.holding, safe = True, at
        else:
            safe = len(text) - _partial_suffix(text, OPEN)
        piece = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return piece

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """-> (the content not sent yet, the calls) once the choice has finished."""
        _, calls, first = parse_tool_calls(text, self.names)
        rest = text[self.sent:first] if first > self.sent else ""
        return (rest.rstrip() if calls else rest), calls


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker`` (a marker maybe still coming)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def _call(body: str, names: list[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def tool_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stream deltas of ``calls``: per call its header, then its arguments in fragments."""
    deltas = []
    for index, call in enumerate(calls):
        function = call["function"]
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": function["name"], "arguments": ""}}]})
        arguments = function["arguments"]
        for start in range(0, len(arguments), ARGUMENT_FRAGMENT_CHARS):
            fragment = arguments[start:start + ARGUMENT_FRAGMENT_CHARS]
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
    return deltas
