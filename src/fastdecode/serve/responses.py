"""OpenAI response objects: whole responses, stream chunks, logprobs and usage."""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .worker import Piece


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float | None, list[tuple[int, float]] | None]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    tool_calls: list[dict[str, Any]] | None = None  # set from the finished text (serve/tool_calls.py)
    drafted_tokens: int = 0  # speculative decoding: draft tokens verified, and of those accepted
    accepted_tokens: int = 0

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        if piece.token_id is not None and piece.token_id >= 0:
            self.token_ids.append(piece.token_id)
            self.logprobs.append((piece.token_id, piece.logprob, piece.top_logprobs))
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.prompt_tokens, self.cached_tokens = piece.prompt_tokens, piece.cached_tokens
        self.completion_tokens = max(self.completion_tokens, piece.completion_tokens)
        self.drafted_tokens += piece.drafted_tokens
        self.accepted_tokens += piece.accepted_tokens


class ResponseBuilder:
    """Builds the objects of one request; ``endpoint`` is "completion" or "chat"."""

    def __init__(self, endpoint: str, model: str, tokenizer: Any, logprobs: int | None):
        self.endpoint, self.model, self.tokenizer, self.logprobs = endpoint, model, tokenizer, logprobs
        self.id = ("cmpl-" if endpoint == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._streamed_offsets: dict[int, _TextOffsets] = {}  # choice index -> where its streamed text is

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = {("completion", False): "text_completion", ("completion", True): "text_completion",
                ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}[self.endpoint, chunk]
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # -- whole responses -------------------------------------------------------------------------
    def response(self, choices: list[ChoiceState], prompt_counts: list[tuple[int, int]]) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        body["choices"] = [self._choice(c) for c in choices]
        body["usage"] = self.usage(choices, prompt_counts)
        return body

    def _choice(self, choice: ChoiceState) -> dict[str, Any]:
        logprobs = self.logprobs_object(choice.logprobs) if self.logprobs is not None else None
        if self.endpoint == "completion":
            return {"index": choice.index, "text": choice.text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason}
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        if choice.tool_calls:
            message = {"role": "assistant", "content": choice.text or None, "tool_calls": choice.tool_calls}
        return {"index": choice.index, "message": message, "logprobs": logprobs, "finish_reason": choice.finish_reason}

    @staticmethod
    def usage(choices: list[ChoiceState], prompt_counts: list[tuple[int, int]]) -> dict[str, Any]:
        """``prompt_counts``: (prompt tokens, of which cached) per distinct prompt of the request."""
        prompt = sum(p for p, _ in prompt_counts)
        completion = sum(c.completion_tokens for c in choices)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                 "prompt_tokens_details": {"cached_tokens": sum(c for _, c in prompt_counts)}}
        drafted = sum(c.drafted_tokens for c in choices)
        if drafted:  # speculative decoding, in OpenAI's predicted-outputs terms
            accepted = sum(c.accepted_tokens for c in choices)
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": drafted - accepted}
        return usage

    # -- stream chunks ---------------------------------------------------------------------------
    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant role (as OpenAI does)."""
        if self.endpoint != "chat":
            return None
        return self.chunk(index, {"role": "assistant", "content": ""}, None, None)

    def piece_chunk(self, piece: Piece) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None and piece.token_id is not None and piece.token_id >= 0:
            logprobs = self.logprobs_object([(piece.token_id, piece.logprob, piece.top_logprobs)],
                                            streamed_choice=piece.index)
        return self.chunk(piece.index, piece.text, logprobs, piece.finish_reason)

    def text_chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.chunk(index, text, None, finish_reason)

    def delta_chunk(self, index: int, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        """A chat chunk with a given delta (tool-call deltas)."""
        return self.chunk(index, delta, None, finish_reason)

    def chunk(self, index: int, content: Any, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        if self.endpoint == "completion":
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            delta = content if isinstance(content, dict) else ({"content": content} if content else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        body["choices"] = [choice]
        return body

    def usage_chunk(self, choices: list[ChoiceState], prompt_counts: list[tuple[int, int]]) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage(choices, prompt_counts)
        return body

    # -- logprobs --------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprobs_object(self, entries: list[tuple[int, float | None, list[tuple[int, float]] | None]],
                        streamed_choice: int | None = None) -> dict[str, Any]:
        """``streamed_choice``: the entries are the next chunk of that choice's stream, whose text
        offsets go on from its earlier chunks' (as in the whole response), not from 0."""
        if self.endpoint == "completion":
            tokens = [self._token(t) for t, _, _ in entries]
            text = _TextOffsets() if streamed_choice is None else \
                self._streamed_offsets.setdefault(streamed_choice, _TextOffsets())
            offsets = [text.add(self.tokenizer.token_bytes(token_id)) for token_id, _, _ in entries]
            return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries],
                    "top_logprobs": [_by_text(top, self._token) for _, _, top in entries] if self.logprobs else None,
                    "text_offset": offsets}
        content = []
        for token_id, logprob, top in entries:  # bytes: the token's own, also part of a character (as OpenAI)
            content.append({"token": self._token(token_id), "logprob": logprob,
                            "bytes": list(self.tokenizer.token_bytes(token_id)),
                            "top_logprobs": [{"token": self._token(i), "logprob": v,
                                              "bytes": list(self.tokenizer.token_bytes(i))} for i, v in top or []]})
        return {"content": content}


class _TextOffsets:
    """Where each next token of a choice starts in its text, in characters. A token holding part of a
    character adds its characters once they are whole (counting its U+FFFD put every later offset past
    its token, once per split character)."""

    def __init__(self) -> None:
        self.characters = codecs.getincrementaldecoder("utf-8")("replace")
        self.at = 0

    def add(self, token_bytes: bytes) -> int:
        """The token's offset; the text then goes on past it."""
        start = self.at
        self.at += len(self.characters.decode(token_bytes))
        return start


def _by_text(top: list[tuple[int, float]] | None, token_text: Any) -> dict[str, float] | None:
    """The legacy completions format keys top logprobs by token text; tokens that read the same
    (e.g. partial UTF-8 bytes) keep the best one."""
    if top is None:
        return None
    entries: dict[str, float] = {}
    for token_id, logprob in top:
        entries.setdefault(token_text(token_id), logprob)
    return entries
