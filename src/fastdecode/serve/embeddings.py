"""``POST /v1/embeddings`` (with ``--embeddings``): OpenAI's request (``input`` a string, a list of
strings, token ids or lists of token ids; ``encoding_format`` "float" or "base64"; ``dimensions``
only as the model's own size) -> one unit-length vector per input, pooled over the final hidden
states (``--pooling mean|last``).

Inputs run as prefill-only forwards (``generation.embedding``) on one embedding thread beside the
engine's: each time it is free it takes every request waiting, and runs all their inputs together,
longest first, in batches of at most ``max_batch_tokens`` padded tokens (concurrent requests share
batches, as sequences share engine steps)."""

from __future__ import annotations

import asyncio
import base64
import queue
import threading
from typing import Any

from fastapi import FastAPI, Request

from ..generation.embedding import embed_token_lists
from ..validation import is_int
from .body import read_json_body
from .names import ModelNames
from .protocol import APIError, _Fields

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}


def add_embeddings_route(app: FastAPI, generator: Any, names: ModelNames, settings: Any) -> None:
    if settings.embeddings is not None and generator.config.is_encoder_decoder:
        raise APIError(400, "--embeddings needs a decoder-only model (this one is an encoder-decoder)")
    batcher = EmbeddingBatcher(generator.model, settings.embeddings, settings.max_batch_tokens)
    context = names.context

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        body = await read_json_body(request, settings.max_body_bytes)
        if settings.embeddings is None:
            raise APIError(400, "this server does not serve embeddings: start it with --embeddings",
                           code="embeddings_disabled")
        unknown = sorted(set(k for k, v in body.items() if v is not None) - FIELDS)
        if unknown:
            raise APIError(400, f"unknown field {unknown[0]!r} for embeddings", param=unknown[0], code="unknown_field")
        fields = _Fields(body)
        model = names.resolve(body.get("model"))
        encoding = fields.get("encoding_format", str, default="float")
        if encoding not in ("float", "base64"):
            raise APIError(400, f"encoding_format must be 'float' or 'base64', got {encoding!r}",
                           param="encoding_format")
        width = generator.config.hidden_size
        dimensions = fields.integer("dimensions", None, low=1)
        if dimensions is not None and dimensions != width:
            raise APIError(400, f"dimensions: this model's embeddings have {width} dimensions; other sizes "
                                "are not available", param="dimensions")
        inputs = _inputs(generator, body.get("input"), context)
        vectors = await batcher.embed(inputs)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
        tokens = sum(len(i) for i in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    app.router.on_shutdown.append(batcher.close)


class EmbeddingBatcher:
    """The embedding thread: requests queue their inputs; each round embeds everything waiting."""

    def __init__(self, model: Any, pooling: str | None, max_batch_tokens: int):
        self.model, self.pooling, self.max_batch_tokens = model, pooling or "mean", max_batch_tokens
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    async def embed(self, inputs: list[list[int]]) -> list[Any]:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastdecode-embed", daemon=True)
            self._thread.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put((inputs, future, loop))
        return await future

    def close(self) -> None:
        self._inbox.put(None)

    def _run(self) -> None:
        while True:
            waiting = [self._inbox.get()]
            while True:
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            requests = [item for item in waiting if item is not None]
            if requests:
                self._round(requests)
            if len(requests) < len(waiting):  # closed
                return

    def _round(self, requests: list[tuple]) -> None:
        every = [ids for inputs, _, _ in requests for ids in inputs]
        try:
            vectors, error = _embed_all(self.model, every, self.pooling, self.max_batch_tokens), None
        except Exception as exc:  # a bug, not bad input (checked before): every waiting request fails
            vectors, error = [], exc
        start = 0
        for inputs, future, loop in requests:
            part = vectors[start : start + len(inputs)]
            start += len(inputs)
            loop.call_soon_threadsafe(_settle, future, part, error)


def _settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _inputs(generator: Any, value: Any, context: int) -> list[list[int]]:
    bad = APIError(400, "input must be a non-empty string, a list of strings, a list of token ids or a list of "
                        "token-id lists", param="input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise bad
    if all(is_int(t) for t in value):
        value = [value]
    vocab = generator.config.vocab_size
    inputs = []
    for item in value:
        if isinstance(item, str) and item:
            if generator.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="input")
            ids = generator.tokenizer.encode(item, add_special_tokens=True)
        elif isinstance(item, list) and item and all(is_int(t) and 0 <= t < vocab for t in item):
            ids = list(item)
        else:
            raise bad
        if len(ids) > context:
            raise APIError(400, f"an input has {len(ids)} tokens, more than the context ({context})", param="input",
                           code="context_length_exceeded")
        inputs.append(ids)
    return inputs


def _embed_all(model: Any, inputs: list[list[int]], pooling: str, max_batch_tokens: int) -> list[list[float]]:
    """Longest first, batches of at most ``max_batch_tokens`` padded tokens (one input at least)."""
    order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
    vectors: list[Any] = [None] * len(inputs)
    start = 0
    while start < len(order):
        longest = len(inputs[order[start]])
        size = max(1, max_batch_tokens // longest)
        batch = order[start : start + size]
        for index, vector in zip(batch, embed_token_lists(model, [inputs[i] for i in batch], pooling)):
            vectors[index] = vector
        start += size
    return vectors


def _encode(vector: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
