"""``POST /v1/embeddings`` (with ``--embeddings``): OpenAI's request (``input`` a string, a list of
strings, token ids or lists of token ids; ``encoding_format`` "float" or "base64"; ``dimensions``
only as the model's own size) -> one unit-length vector per input, pooled over the final hidden
states (``--pooling mean|last``).

The inputs of each request run as prefill-only forwards (``generation.embedding``), longest first
in batches of at most ``max_batch_tokens`` padded tokens, on one embedding thread beside the
engine's (a second request waits for it: embedding work is bounded as generation is)."""

from __future__ import annotations

import asyncio
import base64
from concurrent.futures import ThreadPoolExecutor
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
    pool = ThreadPoolExecutor(1, thread_name_prefix="fastdecode-embed")
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
        vectors = await asyncio.get_running_loop().run_in_executor(
            pool, _embed_all, generator.model, inputs, settings.embeddings, settings.max_batch_tokens)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
        tokens = sum(len(i) for i in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    app.router.on_shutdown.append(lambda: pool.shutdown(wait=False, cancel_futures=True))


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
