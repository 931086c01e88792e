"""A streamed /v1/responses reply with function tools: its output items as OpenAI's typed events,
each item as it is generated (serve/output_items.py reads the calls out of the text):

- a message item: ``response.output_item.added``, ``response.content_part.added``, one
  ``response.output_text.delta`` per piece, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done``;
- a function_call item: ``response.output_item.added`` (``call_id``, ``name``, ``arguments: ""``)
  once its name is generated, ``response.function_call_arguments.delta`` per fragment of its
  arguments, ``response.function_call_arguments.done``, ``response.output_item.done``.

The final response (``response.completed``) holds the items as they were streamed."""

from __future__ import annotations

import uuid
from typing import Any

from .output_items import ItemEvent, OutputItems

Event = tuple[str, dict[str, Any]]  # (the event type, its fields)


class ToolItems:
    """``shell``: the route's response object builder (``part``, ``item`` and ``message_id``, responses_api.py)."""

    def __init__(self, shell: Any):
        self.shell = shell
        self.items = OutputItems(shell.tools.names)
        self.ids: list[str] = []  # each item's id, by position
        self.done: list[dict[str, Any]] = []  # each finished item, by position

    def feed(self, text: str) -> list[Event]:
        return [e for event in self.items.feed(text) for e in self._events(event)]

    def finish(self) -> list[Event]:
        return [e for event in self.items.finish() for e in self._events(event)]

    def output(self) -> list[dict[str, Any]]:
        return list(self.done)

    def _events(self, event: ItemEvent) -> list[Event]:
        at = event.position
        if event.kind in ("text_start", "call_start"):
            first_message = event.kind == "text_start" and not any(i.startswith("msg_") for i in self.ids)
            self.ids.append(self.shell.message_id if first_message else
                            ("msg_" if event.kind == "text_start" else "fc_") + uuid.uuid4().hex[:24])
        where = {"item_id": self.ids[at], "output_index": at}
        part = {**where, "content_index": 0}
        if event.kind == "text_start":
            return [("response.output_item.added", {"output_index": at, "item": self.shell.item(None, self.ids[at])}),
                    ("response.content_part.added", {**part, "part": self.shell.part("")})]
        if event.kind == "text":
            return [("response.output_text.delta", {**part, "delta": event.text, "logprobs": []})]
        if event.kind == "text_end":
            message = self.shell.item(None, self.ids[at])
            message.update(status="completed", content=[self.shell.part(event.text)])
            self.done.append(message)
            return [("response.output_text.done", {**part, "text": event.text, "logprobs": []}),
                    ("response.content_part.done", {**part, "part": self.shell.part(event.text)}),
                    ("response.output_item.done", {"output_index": at, "item": message})]
        call = {"type": "function_call", "id": self.ids[at], "call_id": event.call_id, "name": event.name,
                "arguments": "", "status": "in_progress"}
        if event.kind == "call_start":
            return [("response.output_item.added", {"output_index": at, "item": call})]
        if event.kind == "arguments":
            return [("response.function_call_arguments.delta", {**where, "delta": event.text})]
        call.update(arguments=event.text, status="completed")
        self.done.append(call)
        return [("response.function_call_arguments.done", {**where, "name": event.name, "arguments": event.text}),
                ("response.output_item.done", {"output_index": at, "item": call})]
