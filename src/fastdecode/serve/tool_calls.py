"""Reading tool calls out of a choice's text as it is generated, and writing them the OpenAI way.

The format is Hermes' (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), which is
also fastdecode's generic format (serve/tools.py). ``ToolCallParser`` reads the text piece by
piece (any split, down to one character) and answers OpenAI stream deltas:

- text outside calls is ``{"content": ...}``, except an end that may begin ``<tool_call>`` (held
  until the next piece says) and, once a call was sent, whitespace (held until non-blank text
  follows it; blank text between or after calls is dropped);
- a call is sent as soon as its ``name`` is complete and names an offered function:
  ``{"tool_calls": [{index, id, type: "function", function: {name, arguments: ""}}]}``, then its
  ``arguments`` JSON text in fragments as it comes (``{"tool_calls": [{index, function:
  {arguments}}]}``); the fragments joined are the call's ``arguments`` string. Parallel calls get
  index 0, 1, ...
- a false start (``<tool_call>`` followed by text that is not a call object, a call whose name is
  not offered, or one cut off before its name) is content, character for character.

The states, per character:

    TEXT ── "<tool_call>" ──> CALL, reading the call object's top level (JsonValueEnd reads each
     ^                        key and value whole, whatever they nest or escape):
     |                          OPEN -"{"-> KEY -key-> COLON -":"-> VALUE_START -> VALUE -> AFTER_VALUE
     |                          AFTER_VALUE -","-> KEY;  KEY or AFTER_VALUE -"}"-> CLOSED
     |                          CLOSED: "</tool_call>" (or any other text, then read as TEXT) ends it
     |                        when the "name" value ends and is offered: the call is sent (header);
     |                        while the "arguments" value grows: its fragments are sent
     └──── the call ends; or, before it was sent, anything unexpected: a false start, whose text
           is read again as TEXT (its "<" is content, the rest may hold a real call)

Not a JSON validator: a call sent whose arguments turn out not to be JSON (only possible for
``tool_choice`` "auto"; "required" and named calls are grammar-forced) or that is cut off
(``max_tokens``) stays sent, as OpenAI's streams do; the whole-response form (``parse_tool_calls``)
returns only complete calls with valid JSON arguments and leaves the others' text in the content.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # "parameters": some templates' spelling
BLANK = " \t\r\n"


class JsonValueEnd:
    """Finds where one JSON value ends, character by character (strings, escapes, nesting)."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0  # open {/[ not yet closed
        self.in_string = self.escaped = self.complete = False

    def take(self, char: str) -> bool:
        """Add ``char`` if the value goes on with it; False if the value had ended before it."""
        if self.complete:
            return False
        scalar = self.text != "" and self.text[0] not in '{["'
        if scalar and not self.in_string and char in BLANK + ",}]":
            self.complete = True  # numbers, true, false, null end at the next delimiter
            return False
        self.text += char
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
        self.complete = not scalar and not self.in_string and self.depth == 0
        return True


class CallBlock:
    """The call being read: its raw text and where the reading of its JSON object is."""

    def __init__(self) -> None:
        self.raw = OPEN  # everything read since (and with) "<tool_call>"
        self.state = "OPEN"
        self.key: str | None = None
        self.value: JsonValueEnd | None = None
        self.name: str | None = None
        self.arguments: str | None = None  # the arguments' JSON text so far
        self.index: int | None = None  # set once the call was sent
        self.closing = ""  # the part of "</tool_call>" matched in CLOSED


class ToolCallParser:
    """One choice of a request with tools: ``feed`` each new piece of text, then ``finish``; both
    answer the OpenAI stream deltas to send. See the module docstring for the states."""

    def __init__(self, names: list[str]):
        self.names = names
        self.calls: list[dict[str, Any]] = []  # the calls sent, in OpenAI's form
        self.valid: list[bool] = []  # per sent call: complete, with JSON arguments
        self.content: list[str] = []  # the message's content: text that is not a valid call
        self.cut_off = False  # a sent call was still open when the choice ended
        self._tag = ""  # TEXT: an end that may begin "<tool_call>"
        self._blank = ""  # TEXT after a call: whitespace held
        self._block: CallBlock | None = None
        self._input, self._at = "", 0  # text still to read, and where
        self._deltas: list[dict[str, Any]] = []

    # -- the public steps ----------------------------------------------------------------------
    def feed(self, text: str) -> list[dict[str, Any]]:
        self._input, self._at = self._input[self._at:] + text, 0
        self._read()
        return self._take_deltas()

    def finish(self) -> list[dict[str, Any]]:
        """The choice has ended: release what is held, end the call being read."""
        while self._block is not None or self._tag:
            block = self._block
            if block is not None and block.index is None:
                self._false_start(block)
            elif block is not None:
                if block.state == "CLOSED":
                    self._end_call(block, "")
                else:
                    self.cut_off = True
                    self._end_call(block, "", complete=False)
            else:
                tag, self._tag = self._tag, ""
                self._plain(tag)
            self._read()
        return self._take_deltas()

    def finish_reason(self, engine_reason: str) -> str:
        """A streamed choice's reason: "tool_calls" once a call was sent (unless one was cut off)."""
        return "tool_calls" if self.calls and not self.cut_off else engine_reason

    def valid_calls(self) -> list[dict[str, Any]]:
        return [call for call, ok in zip(self.calls, self.valid) if ok]

    @property
    def open_call(self) -> int | None:
        """The index of the sent call still being read (its arguments may grow), else None."""
        return self._block.index if self._block is not None else None

    def _read(self) -> None:
        """Read the input: plain text in runs, a possible tag or a call character by character."""
        while self._at < len(self._input):
            if self._block is None and not self._tag:  # plain text up to the next "<" in one go
                end = self._input.find("<", self._at)
                end = len(self._input) if end < 0 else end
                if end > self._at:
                    self._plain(self._input[self._at:end])
                    self._at = end
                    continue
            char = self._input[self._at]
            self._at += 1
            if self._block is None:
                self._text_char(char)
            else:
                self._block.raw += char
                self._call_char(self._block, char)

    # -- TEXT -----------------------------------------------------------------------------------
    def _text_char(self, char: str) -> None:
        if OPEN.startswith(self._tag + char):
            self._tag += char
            if self._tag == OPEN:
                self._tag, self._block = "", CallBlock()
            return
        if not self._tag:
            self._plain(char)
            return
        held, self._tag = self._tag, ""  # not a call after all: its first character is text
        self._plain(held[0])
        self._reread(held[1:] + char)

    def _plain(self, text: str) -> None:
        if self.calls:  # blank text between or after calls is not content
            if text.strip(BLANK) == "":
                self._blank += text
                return
            text, self._blank = self._blank + text, ""
        self.content.append(text)
        self._delta({"content": text})

    # -- CALL -----------------------------------------------------------------------------------
    def _call_char(self, block: CallBlock, char: str) -> None:
        state = block.state
        if state == "VALUE":
            if block.value.take(char):
                self._value_grew(block, char)
                if not block.value.complete:
                    return
                char = ""
            self._value_ended(block)
            if block is not self._block or not char:
                return
            state = block.state
        if char in BLANK and state != "CLOSED":
            return
        if state == "OPEN" and char == "{" or state == "AFTER_VALUE" and char == ",":
            block.state = "KEY"
        elif state == "KEY" and char == '"':
            block.state, block.value, block.key = "VALUE", JsonValueEnd(), None
            block.value.take(char)
        elif state == "COLON" and char == ":":
            block.state = "VALUE_START"
        elif state == "VALUE_START":
            block.state, block.value = "VALUE", JsonValueEnd()
            self._call_char(block, char)
        elif state in ("KEY", "AFTER_VALUE") and char == "}":
            self._object_closed(block)
        elif state == "CLOSED":
            self._closing_char(block, char)
        else:
            self._broken(block)

    def _value_grew(self, block: CallBlock, char: str) -> None:
        """Arguments given as JSON (not as a string holding JSON) stream as they are read."""
        if block.key in ARGUMENT_KEYS and block.value.text[0] != '"':
            block.arguments = block.value.text
            if block.index is not None:
                self._arguments(block.index, char)

    def _value_ended(self, block: CallBlock) -> None:
        text, block.value = block.value.text, None
        if block.key is None:  # the value was a key
            block.key, block.state = _json(text), "COLON"
            if not isinstance(block.key, str):
                self._broken(block)
            return
        block.state = "AFTER_VALUE"
        if block.key == "name":
            block.name = _json(text)
            if block.name not in self.names:
                self._broken(block)
            elif block.index is None:
                self._send_call(block)
        elif block.key in ARGUMENT_KEYS and text.startswith('"'):
            inner = _json(text)  # arguments sent as a string of JSON: sent once whole
            block.arguments = inner if isinstance(inner, str) else text
            if block.index is not None:
                self._arguments(block.index, block.arguments)

    def _send_call(self, block: CallBlock) -> None:
        self._blank = ""  # blank text between two calls is not content
        block.index = len(self.calls)
        call = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": block.name, "arguments": ""}}
        self.calls.append(call)
        self.valid.append(False)
        self._delta({"tool_calls": [{"index": block.index, "id": call["id"], "type": "function",
                                     "function": {"name": block.name, "arguments": ""}}]})
        if block.arguments:  # read before the name
            self._arguments(block.index, block.arguments)

    def _object_closed(self, block: CallBlock) -> None:
        if block.index is None:  # no offered name: not a call
            self._false_start(block)
            return
        if block.arguments is None:
            block.arguments = "{}"
            self._arguments(block.index, "{}")
        block.state = "CLOSED"

    def _closing_char(self, block: CallBlock, char: str) -> None:
        if not block.closing and char in BLANK:
            return
        if CLOSE.startswith(block.closing + char):
            block.closing += char
            if block.closing == CLOSE:
                self._end_call(block, "")
            return
        self._end_call(block, block.closing + char)  # no closing tag: what follows is read as text

    def _broken(self, block: CallBlock) -> None:
        """Text that cannot be this call: a false start, or the end of a call already sent."""
        if block.index is None:
            self._false_start(block)
        else:
            self._end_call(block, block.raw[-1:], complete=False)

    def _false_start(self, block: CallBlock) -> None:
        """Not a call: its "<" is text and the rest is read again as text."""
        self._block = None
        self._plain(block.raw[0])
        self._reread(block.raw[1:])

    def _end_call(self, block: CallBlock, reread: str, complete: bool = True) -> None:
        self._block = None
        ok = complete and block.state == "CLOSED" and _json(block.arguments) is not _NOT_JSON
        self.valid[block.index] = ok
        if not ok:  # the whole response keeps its text as content
            self.content.append(block.raw[:len(block.raw) - len(reread)])
        self._reread(reread)

    def _reread(self, text: str) -> None:
        """Read ``text`` again, before what is still to read."""
        self._input, self._at = text + self._input[self._at:], 0

    # -- deltas ---------------------------------------------------------------------------------
    def _arguments(self, index: int, text: str) -> None:
        self.calls[index]["function"]["arguments"] += text
        self._delta({"tool_calls": [{"index": index, "function": {"arguments": text}}]})

    def _delta(self, delta: dict[str, Any]) -> None:
        """Add a delta, joined to the last one when both are content or fragments of one call."""
        last = self._deltas[-1] if self._deltas else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
        elif (last is not None and "tool_calls" in delta and "tool_calls" in last
              and "id" not in delta["tool_calls"][0] and "id" not in last["tool_calls"][0]
              and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"]["arguments"]
        else:
            self._deltas.append(delta)

    def _take_deltas(self) -> list[dict[str, Any]]:
        deltas, self._deltas = self._deltas, []
        return deltas


_NOT_JSON = object()


def _json(text: str | None) -> Any:
    try:
        return json.loads(text)
    except (TypeError, json.JSONDecodeError):
        return _NOT_JSON


def parse_tool_calls(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    """A finished choice's text -> (its content: the text that is not a valid call, stripped, None
    if blank; the complete calls with JSON arguments). No calls: (the text unchanged, [])."""
    parser = ToolCallParser(names)
    parser.feed(text)
    parser.finish()
    calls = parser.valid_calls()
    if not calls:
        return text, []
    return "".join(parser.content).strip() or None, calls
