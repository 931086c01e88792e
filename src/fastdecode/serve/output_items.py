"""A streamed reply with tools as a sequence of output items, for the APIs that stream items rather
than chat deltas: the Responses API's output items (responses_api.py) and Anthropic's content blocks
(anthropic_api.py) are both a list where each entry is a text or a tool call, opened, grown and
closed in turn.

``OutputItems`` reads the reply piece by piece through ``ToolCallParser`` (serve/tool_calls.py:
a call is opened as soon as its name is read, its arguments JSON grows in fragments as generated)
and answers ``ItemEvent``s:

- ``text_start`` / ``text`` / ``text_end``: a text item. It opens at the first non-blank text
  (blank text before a call is dropped, as the whole response strips its content);
- ``call_start`` (``call_id``, ``name``) / ``arguments`` (a fragment) / ``call_end`` (the whole
  arguments): a call item, closed when the parser has read its end (or when the reply ends).

``position`` counts the items from 0 in the order they open (the Responses ``output_index``, the
Anthropic block ``index``). A reply with neither text nor calls still gets one (empty) text item.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .tool_calls import BLANK, ToolCallParser


@dataclass
class ItemEvent:
    kind: str  # text_start, text, text_end, call_start, arguments, call_end
    position: int
    text: str = ""  # text: the delta; text_end: the item's whole text; arguments: the fragment; call_end: all
    call_id: str = ""  # call_*
    name: str = ""  # call_*


@dataclass
class OutputItem:
    """A finished item: a text (``call_id`` empty) or a call."""

    text: str = ""  # the text, or the call's arguments JSON
    call_id: str = ""
    name: str = ""

    @property
    def is_call(self) -> bool:
        return bool(self.call_id)


class OutputItems:
    def __init__(self, names: list[str]):
        self.parser = ToolCallParser(names)
        self.items: list[OutputItem] = []  # finished and open, in order
        self._open: OutputItem | None = None
        self._call_index: int | None = None  # the parser's index of the open call
        self._held = ""  # blank text no item was opened for yet
        self._events: list[ItemEvent] = []

    @property
    def called(self) -> bool:
        """A call was sent and none was cut off: the reply's reason is a tool call."""
        return self.parser.finish_reason("stop") == "tool_calls"

    def feed(self, text: str) -> list[ItemEvent]:
        self._apply(self.parser.feed(text))
        if self._call_index is not None and self.parser.open_call != self._call_index:
            self._close()  # the parser read the call's end
        return self._take()

    def finish(self) -> list[ItemEvent]:
        self._apply(self.parser.finish())
        self._close()
        if not self.items:
            self._open_text(self._held)
            self._close()
        return self._take()

    # -- the parser's chat deltas -> item events --------------------------------------------------
    def _apply(self, deltas: list[dict[str, Any]]) -> None:
        for delta in deltas:
            if "content" in delta:
                self._text(delta["content"])
                continue
            call = delta["tool_calls"][0]
            if "id" in call:
                self._close()
                self._held = ""  # blank text before a call is not content
                self._call_index = call["index"]
                self._start(OutputItem(call_id=call["id"], name=call["function"]["name"]), "call_start")
            fragment = call["function"]["arguments"]
            if fragment:
                self._open.text += fragment
                self._emit("arguments", fragment)

    def _text(self, text: str) -> None:
        if self._open is not None and not self._open.is_call:
            self._open.text += text
            self._emit("text", text)
            return
        if text.strip(BLANK) == "":
            self._held += text
            return
        self._close()
        self._open_text(self._held + text)

    def _open_text(self, text: str) -> None:
        self._held = ""
        self._start(OutputItem(), "text_start")
        if text:
            self._open.text = text
            self._emit("text", text)

    def _start(self, item: OutputItem, kind: str) -> None:
        self.items.append(item)
        self._open = item
        self._emit(kind)

    def _close(self) -> None:
        item, self._open, self._call_index = self._open, None, None
        if item is not None:
            self._events.append(ItemEvent("call_end" if item.is_call else "text_end", len(self.items) - 1, item.text,
                                          item.call_id, item.name))

    def _emit(self, kind: str, text: str = "") -> None:
        item = self._open
        self._events.append(ItemEvent(kind, len(self.items) - 1, text, item.call_id, item.name))

    def _take(self) -> list[ItemEvent]:
        events, self._events = self._events, []
        return events
