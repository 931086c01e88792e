"""``POST /v1/messages``: Anthropic's Messages API, text only (what llama.cpp's server and vLLM also
serve): ``system`` (a string or text blocks), ``messages`` (user / assistant turns of text),
``max_tokens`` (required), ``stop_sequences``, ``temperature`` (0..1), ``top_p``, ``top_k``,
``metadata``, ``seed`` (fastdecode's), ``stream`` (``message_start``, ``content_block_start``, ``content_block_delta``,
``content_block_stop``, ``message_delta``, ``message_stop`` events), custom tools with tool_use /
tool_result blocks (anthropic_tools.py). Server tools, images, thinking and a trailing assistant
turn (prefill) are a 400 naming the field. Errors have Anthropic's shape;
``x-api-key`` is accepted as the key header (app.py's guard)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .adapters import Outcome, collect, deltas, start_chat, text_of
from .anthropic_tools import block_messages, chat_tool_fields, tool_use_blocks, tool_use_id
from .body import read_json_body
from .fields import check_known
from .names import ModelNames
from .output_items import ItemEvent, OutputItems
from .protocol import MAX_STOPS, APIError
from .service import GenerationService, ServeSettings

PATH = "/v1/messages"
SERVED = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature", "top_p", "top_k", "stream",
          "metadata", "seed", "tools", "tool_choice"}  # seed: fastdecode's extra (choice samples as offline generate(seed=...))
REFUSED = {"thinking": "extended thinking is not available", "mcp_servers": "MCP servers are not available",
           "container": "containers are not available", "context_management": "context management is not available",
           "service_tier": "there is one service tier"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(exc: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(exc.status, "api_error"), "message": exc.message}}


def add_messages_route(app: FastAPI, service: GenerationService, names: ModelNames, settings: ServeSettings) -> None:
    @app.post(PATH)
    async def messages(request: Request) -> Response:
        body = await read_json_body(request, settings.max_body_bytes)
        chat_body, model = messages_chat_body(body, names, settings.lenient)
        parsed, running = await start_chat(service, request, chat_body, model)
        message_id = "msg_" + uuid.uuid4().hex[:24]
        if body.get("stream"):
            return StreamingResponse(_events(running, message_id, model, parsed.tools), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        outcome = await collect(running)
        if running.cancelled:
            return Response(status_code=499)
        text, calls = tool_use_blocks(outcome.text, parsed.tools)
        message = _message(message_id, model, outcome, used_tools=bool(calls))
        message["content"] = ([{"type": "text", "text": text}] if text or not calls else []) + calls
        return JSONResponse(message)


def messages_chat_body(body: dict[str, Any], names: ModelNames, lenient: bool) -> tuple[dict[str, Any], str]:
    """A Messages API body -> (the chat body it means, the model name it is answered as); a 400
    naming what is not served (also the Ray Serve ingress's check, before it forwards)."""
    check_known(body, SERVED, REFUSED, lenient, "Messages API")
    check_message_keys(body.get("messages"), lenient)
    model = names.resolve(body.get("model"))
    return _chat_body(body, model), model


# The keys of a message and of each content block type (cache_control: the prefix cache is automatic; a
# tool_result's is_error is not shown to the model, as README says).
BLOCK_KEYS = {"message": {"role", "content"}, "text": {"type", "text", "cache_control", "citations"},
              "tool_use": {"type", "id", "name", "input", "cache_control"},
              "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"}}


def check_message_keys(messages: Any, lenient: bool) -> None:
    """A 400 naming ``messages[i].key`` (or ``messages[i].content[j].key``) for a non-null key its message or
    block does not take; with ``lenient`` it is logged and ignored. Bad shapes are _chat_body's to name."""
    for index, message in enumerate(messages if isinstance(messages, list) else []):
        parts = [(f"messages[{index}].", "message", message)]
        content = message.get("content") if isinstance(message, dict) else None
        parts += [(f"messages[{index}].content[{j}].", block.get("type"), block)
                  for j, block in enumerate(content if isinstance(content, list) else []) if isinstance(block, dict)]
        for where, kind, part in parts:
            if isinstance(part, dict) and kind in BLOCK_KEYS:
                check_known(part, BLOCK_KEYS[kind], {}, lenient, "Messages API", lambda name, kind=kind: (
                    f" (a {kind} takes {', '.join(sorted(BLOCK_KEYS[kind]))})"), where=where)


def _chat_body(body: dict[str, Any], model: str) -> dict[str, Any]:
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise APIError(400, f"model must be a string, got {type(body['model']).__name__}", param="model")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise APIError(400, f"max_tokens (an integer >= 1) is required, got {max_tokens!r}", param="max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and (not isinstance(stops, list) or len(stops) > MAX_STOPS
                              or not all(isinstance(stop, str) and stop for stop in stops)):
        raise APIError(400, f"stop_sequences must be a list of at most {MAX_STOPS} non-empty strings",
                       param="stop_sequences")
    temperature = body.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or not 0 <= temperature <= 1):
        raise APIError(400, f"temperature must be a number in [0, 1], got {temperature!r}", param="temperature")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content}", param="messages")
    chat = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": text_of(body["system"], "system", ("text",))})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        chat += block_messages(message["role"], message.get("content"), f"{where}.content")
    if chat[-1]["role"] == "assistant":
        raise APIError(400, "continuing a trailing assistant message (prefill) is not supported: end with a user turn",
                       param=f"messages[{len(messages) - 1}]")
    return {"model": model, "messages": chat, "max_tokens": body["max_tokens"], "stream": body.get("stream"),
            "temperature": temperature, "top_p": body.get("top_p"), "top_k": body.get("top_k"),
            "stop": body.get("stop_sequences") or None, "seed": body.get("seed"), **chat_tool_fields(body)}


def _stop_reason(outcome: Outcome, used_tools: bool = False) -> str:
    if used_tools:
        return "tool_use"
    if outcome.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def _message(message_id: str, model: str, outcome: Outcome | None, prompt_tokens: int = 0,
             used_tools: bool = False) -> dict[str, Any]:
    done = outcome is not None
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": _stop_reason(outcome, used_tools) if done else None,
            "stop_sequence": outcome.stop_sequence if done else None,
            "usage": {"input_tokens": outcome.prompt_tokens if done else prompt_tokens,
                      "output_tokens": outcome.completion_tokens if done else 0,
                      "cache_read_input_tokens": outcome.cached_tokens if done else 0}}


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def _events(running: Any, message_id: str, model: str, tools: Any) -> AsyncIterator[str]:
    """Text streams as it comes. With tools, each block opens as it is generated: a tool_use block
    once the call's name is read, its input JSON in ``input_json_delta`` fragments (output_items.py)."""
    items = OutputItems(tools.names) if tools is not None and tools.parses_output else None
    yield _event("message_start", {"message": _message(message_id, model, None, running.prompt_lengths[0])})
    if items is None:
        yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    try:
        async for item in deltas(running):
            if not isinstance(item, Outcome):
                for kind, data in (_block_events(items.feed(item)) if items is not None
                                   else [("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                        "text": item}})]):
                    yield _event(kind, data)
                continue
            for kind, data in (_block_events(items.finish()) if items is not None
                               else [("content_block_stop", {"index": 0})]):
                yield _event(kind, data)
            yield _event("message_delta", {"delta": {"stop_reason": _stop_reason(item, items is not None and items.called),
                                                     "stop_sequence": item.stop_sequence},
                                           "usage": {"output_tokens": item.completion_tokens}})
            yield _event("message_stop", {})
    except APIError as exc:
        yield _event("error", {"error": anthropic_error(exc)["error"]})
    finally:
        running.cancel()


def _block_events(events: list[ItemEvent]) -> list[tuple[str, dict[str, Any]]]:
    """Output item events -> content block events (a text block, or a tool_use block)."""
    blocks = []
    for event in events:
        at = event.position
        if event.kind == "text_start":
            blocks.append(("content_block_start", {"index": at, "content_block": {"type": "text", "text": ""}}))
        elif event.kind == "call_start":
            block = {"type": "tool_use", "id": tool_use_id(event.call_id), "name": event.name, "input": {}}
            blocks.append(("content_block_start", {"index": at, "content_block": block}))
        elif event.kind == "text":
            blocks.append(("content_block_delta", {"index": at, "delta": {"type": "text_delta", "text": event.text}}))
        elif event.kind == "arguments":
            blocks.append(("content_block_delta", {"index": at, "delta": {"type": "input_json_delta",
                                                                          "partial_json": event.text}}))
        else:
            blocks.append(("content_block_stop", {"index": at}))
    return blocks
