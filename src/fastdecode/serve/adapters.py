"""Other APIs over the same chat machinery: a route translates its body into an OpenAI chat body
(validated by ``parse_request`` as /v1/chat/completions is), then runs and reads it here, whole
(``collect``) or as text deltas (``deltas``). One choice per request (n = 1)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from .lifetime import lifetime_of
from .parsing import parse_translated_chat
from .protocol import APIError, GenerationRequest
from .service import GenerationService, RunningRequest
from .structured import attach_constraints


@dataclass
class Outcome:
    text: str = ""
    finish_reason: str | None = None  # "stop" or "length"
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


async def start_chat(service: GenerationService, request: Request, chat_body: dict[str, Any],
                     model: str) -> tuple[GenerationRequest, RunningRequest]:
    parsed = parse_translated_chat(chat_body, model)
    attach_constraints(parsed, chat_body)  # a response_format the route translated (structured.py)
    running = await service.start_request(parsed, service.encode(parsed))
    lifetime_of(request).on_disconnect(running.cancel)
    return parsed, running


async def deltas(running: RunningRequest) -> AsyncIterator[str | Outcome]:
    """Each non-empty text piece as it comes, then the Outcome."""
    outcome = Outcome(prompt_tokens=running.prompt_lengths[0])
    async for piece in running.pieces():
        outcome.text += piece.text
        outcome.prompt_tokens = piece.prompt_tokens or outcome.prompt_tokens
        outcome.cached_tokens = piece.cached_tokens
        outcome.completion_tokens = max(outcome.completion_tokens, piece.completion_tokens)
        if piece.finish_reason is not None:
            outcome.finish_reason, outcome.stop_sequence = piece.finish_reason, piece.stop_sequence
        if piece.text:
            yield piece.text
    yield outcome


async def collect(running: RunningRequest) -> Outcome:
    async for item in deltas(running):
        if isinstance(item, Outcome):
            return item
    raise APIError(499, "the client went away")  # pieces() ended without an outcome: cancelled


def text_of(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    """A string, or a list of text parts ({"type": one of part_types, "text"}) joined; else a 400."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}[{index}] must be a text part ({' or '.join(part_types)}); "
                                    f"{kind!r} parts are not supported", param=f"{where}[{index}]")
        return "".join(part["text"] for part in content)
    raise APIError(400, f"{where} must be a string or a list of text parts", param=where)
