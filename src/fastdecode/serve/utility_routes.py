"""llama.cpp's token routes: ``POST /tokenize`` ``{"content", "add_special", "with_pieces"}`` ->
``{"tokens": [id, ...]}`` (or ``[{"id", "piece"}, ...]`` with ``with_pieces``: each token decoded
alone, special tokens spelled out), and ``POST /detokenize`` ``{"tokens": [id, ...]}`` ->
``{"content": text}``. Both behind the API key, as /v1/ routes."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

from ..validation import is_int
from .body import read_json_body
from .protocol import APIError, _Fields

TOKEN_ROUTES = ("/tokenize", "/detokenize")


def add_token_routes(app: FastAPI, generator: Any, max_body_bytes: int) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, max_body_bytes)
        fields = _known(body, {"content", "add_special", "with_pieces"})
        content = fields.get("content", str, default=None)
        if content is None:
            raise APIError(400, "content (the text to tokenize) is required", param="content")
        ids = _tokenizer(generator).encode(content, add_special_tokens=fields.get("add_special", bool, default=False))
        if not fields.get("with_pieces", bool, default=False):
            return {"tokens": ids}
        return {"tokens": [{"id": token, "piece": _piece(generator, token)} for token in ids]}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, max_body_bytes)
        tokens = _known(body, {"tokens"}).get("tokens", list, default=[])
        vocab = generator.config.vocab_size
        if not all(is_int(t) and 0 <= t < vocab for t in tokens):
            raise APIError(400, f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
        return {"content": _tokenizer(generator).decode(tokens, skip_special_tokens=False)}


def _known(body: dict[str, Any], names: set[str]) -> _Fields:
    unknown = sorted(set(body) - names)
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r}: this route takes {', '.join(sorted(names))}",
                       param=unknown[0], code="unknown_field")
    return _Fields(body)


def _tokenizer(generator: Any) -> Any:
    if generator.tokenizer is None:
        raise APIError(400, "this model has no tokenizer", code="no_tokenizer")
    return generator.tokenizer


def _piece(generator: Any, token: int) -> str:
    return generator.tokenizer.decode([token], skip_special_tokens=False)
