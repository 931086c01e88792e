"""``POST /v1/responses``: the stateless core of OpenAI's Responses API, text only: ``input`` (a
string, or message items with text parts), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p``, ``text.format`` (text, json_object, or json_schema: the output then follows the schema,
constrained as ``response_format`` is on chat), function ``tools`` (responses_tools.py), ``metadata`` / ``user`` / ``safety_identifier`` /
``prompt_cache_key``, and ``stream`` with the typed ``response.*`` events. Nothing is stored:
``store: true``, ``previous_response_id``, conversations, background runs, built-in tools and reasoning
are a 400 naming the field."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .adapters import Outcome, collect, deltas, start_chat, text_of
from .body import read_json_body
from .fields import check_known
from .names import ModelNames
from .protocol import APIError
from .responses_stream import ToolItems
from .responses_tools import chat_tool_fields, merge_calls, split_calls, tool_item_message
from .service import GenerationService, ServeSettings

SERVED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
          "text", "truncation", "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier",
          "include", "background",  # these last ones only with their neutral values (below)
          "tools", "tool_choice", "parallel_tool_calls",  # function tools (responses_tools.py)
          "seed"}  # fastdecode's extra: samples as offline generate(seed=...)
REFUSED = {
    "previous_response_id": "responses are not stored (stateless server): send the whole conversation as input",
    "conversation": "conversations are not stored (stateless server)",
    "max_tool_calls": "a limit on tool calls is not implemented",
    "reasoning": "this server runs no reasoning control", "prompt": "stored prompt templates are not available",
    "top_logprobs": "logprobs are not available on this route (use /v1/chat/completions)",
    "stream_options": "no stream options are implemented", "moderation": "moderation is not available",
    "image": "image generation is not available", "context_management": "context management is not available",
    "background_options": "background runs are not available", "access_programs": "not available",
    "prompt_cache_options": "the prefix cache has no options to set",
    "prompt_cache_retention": "the prefix cache has no retention policy to choose",
}
NEUTRAL = {"store": (False,), "truncation": ("disabled",), "service_tier": ("auto", "default"), "include": ([],),
           "background": (False,)}
ROLES = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",),
         "assistant": ("output_text", "input_text")}


def add_responses_route(app: FastAPI, service: GenerationService, names: ModelNames, settings: ServeSettings) -> None:
    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        body = await read_json_body(request, settings.max_body_bytes)
        chat_body, model = responses_chat_body(body, names, settings.lenient)
        parsed, running = await start_chat(service, request, chat_body, model)
        shell = _Shell(body, model, parsed.tools)
        if body.get("stream"):
            return StreamingResponse(_events(running, shell), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outcome = await collect(running)
        if running.cancelled:
            return Response(status_code=499)
        return JSONResponse(shell.response(outcome))


def responses_chat_body(body: dict[str, Any], names: ModelNames, lenient: bool) -> tuple[dict[str, Any], str]:
    """A Responses API body -> (the chat body it means, the model name it is answered as); a 400
    naming what is not served (also the Ray Serve ingress's check, before it forwards)."""
    check_known(body, SERVED, REFUSED, lenient, "Responses API")
    for name, allowed in NEUTRAL.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise APIError(400, f"{name}={body[name]!r} is not supported (a stateless, text-only server): "
                                f"use {allowed[0]!r} or leave it out", param=name, code="unsupported_field")
    model = names.resolve(body.get("model"))
    return {**_chat_body(body, model), "response_format": _response_format(body.get("text")),
            **chat_tool_fields(body)}, model


def _response_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` -> the chat ``response_format`` it means (None for plain text): ``json_object``,
    or ``json_schema`` with ``name``, ``schema`` (and ``strict``, ``description``) flat in the format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    others = sorted(k for k, v in text.items() if k != "format" and v is not None) if isinstance(text, dict) else []
    if not isinstance(text, dict) or others:
        raise APIError(400, "text takes a format ({'type': 'text' | 'json_object' | 'json_schema', ...})"
                            + (f"; text.{others[0]} is not supported" if others else ""), param="text")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if fmt == {"type": "json_object"}:
        return fmt
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": inner}
    raise APIError(400, "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
                        "'name', 'schema'}", param="text.format")


def _chat_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    chat = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise APIError(400, "instructions must be a string", param="instructions")
        chat.append({"role": "system", "content": body["instructions"]})
    limit = body.get("max_output_tokens")  # checked here so that the error names the field the client sent
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise APIError(400, f"max_output_tokens must be an integer >= 1, got {limit!r}", param="max_output_tokens")
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "input must be a non-empty string or a list of message items", param="input")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        tool_message = tool_item_message(item, where) if isinstance(item, dict) else None
        if tool_message is not None:
            chat.append(tool_message)
            continue
        if not isinstance(item, dict) or item.get("type", "message") != "message" or item.get("role") not in ROLES:
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise APIError(400, f"{where} must be a message item with role user, system, developer or assistant "
                                f"({kind!r} items are not supported)", param=where)
        role = "system" if item["role"] == "developer" else item["role"]
        chat.append({"role": role, "content": text_of(item.get("content"), f"{where}.content", ROLES[item["role"]])})
    return {"model": model, "messages": merge_calls(chat), "max_completion_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stream": body.get("stream"),
            "seed": body.get("seed")}


class _Shell:
    """The response object around the generated text, as OpenAI shapes it."""

    def __init__(self, body: dict[str, Any], model: str, tools: Any):
        self.body, self.model, self.tools = body, model, tools
        self.id, self.message_id = "resp_" + uuid.uuid4().hex[:24], "msg_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def response(self, outcome: Outcome | None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object: in progress (no outcome), or finished with ``output`` (default: the
        items read from the outcome's text)."""
        body = self.body
        incomplete = outcome is not None and outcome.finish_reason == "length"
        status = "in_progress" if outcome is None else "incomplete" if incomplete else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
                "metadata": body.get("metadata") or {}, "user": body.get("user"), "store": False,
                "parallel_tool_calls": body.get("parallel_tool_calls", True),
                "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
                "tools": body.get("tools") or [], "truncation": "disabled",
                "text": body.get("text") or {"format": {"type": "text"}}, "previous_response_id": None,
                "reasoning": None,
                "output": [] if outcome is None else output if output is not None else self.output(outcome),
                "usage": None if outcome is None else self.usage(outcome)}

    def output(self, outcome: Outcome) -> list[dict[str, Any]]:
        """The message item (when there is text) and the function_call items of the calls it holds."""
        content, calls = split_calls(outcome.text, self.tools)
        message = [self.item(Outcome(**{**outcome.__dict__, "text": content}))] if content or not calls else []
        return message + calls

    def part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, outcome: Outcome | None, item_id: str | None = None) -> dict[str, Any]:
        done = outcome is not None
        return {"type": "message", "id": item_id or self.message_id, "role": "assistant",
                "status": "completed" if done else "in_progress", "content": [self.part(outcome.text)] if done else []}

    @staticmethod
    def usage(outcome: Outcome) -> dict[str, Any]:
        return {"input_tokens": outcome.prompt_tokens, "output_tokens": outcome.completion_tokens,
                "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
                "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}


async def _events(running: Any, shell: _Shell) -> AsyncIterator[str]:
    """The typed events, text as it comes. With tools, each output item (text, or a function call
    from its name on, its arguments in fragments) opens, grows and closes as it is generated
    (responses_stream.py); the final response holds the items as streamed."""
    number = 0

    def event(kind: str, **data: Any) -> str:
        nonlocal number
        number += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': number - 1, **data})}\n\n"

    where = {"item_id": shell.message_id, "output_index": 0, "content_index": 0}
    items = ToolItems(shell) if shell.tools is not None and shell.tools.parses_output else None
    yield event("response.created", response=shell.response(None))
    yield event("response.in_progress", response=shell.response(None))
    if items is None:
        yield event("response.output_item.added", output_index=0, item=shell.item(None))
        yield event("response.content_part.added", part=shell.part(""), **where)
    try:
        async for item in deltas(running):
            if isinstance(item, Outcome):
                if items is not None:
                    for kind, data in items.finish():
                        yield event(kind, **data)
                    final = shell.response(item, items.output())
                else:
                    yield event("response.output_text.done", text=item.text, logprobs=[], **where)
                    yield event("response.content_part.done", part=shell.part(item.text), **where)
                    yield event("response.output_item.done", output_index=0, item=shell.item(item))
                    final = shell.response(item)
                yield event("response.completed" if final["status"] == "completed" else "response.incomplete",
                            response=final)
            elif items is not None:
                for kind, data in items.feed(item):
                    yield event(kind, **data)
            else:
                yield event("response.output_text.delta", delta=item, logprobs=[], **where)
    except APIError as exc:
        yield event("error", code=exc.code, message=exc.message, param=exc.param)
    finally:
        running.cancel()
