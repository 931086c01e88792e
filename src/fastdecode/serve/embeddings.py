"""``POST /v1/embeddings`` (with ``--embeddings``): OpenAI's request (``input`` a string, a list of
strings, token ids or lists of token ids; ``encoding_format`` "float" or "base64"; ``dimensions``
only as the model's own size) -> one unit-length vector per input, pooled over the final hidden
states (``--pooling mean|last``).

Each input runs as an embedding sequence of the server's one engine (engine/embedding_rows.py),
submitted to the engine thread as any request: its tokens run in the same steps as generation and
scoring, chunked like a prompt, and it ends with its pooled vector, freeing its blocks. A client that
goes away cancels the inputs still running."""

from __future__ import annotations

import asyncio
import base64
import itertools
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from ..engine.embedding_rows import submit_embedding
from ..validation import is_int
from .body import read_json_body
from .lifetime import lifetime_of
from .names import ModelNames
from .protocol import APIError, _Fields
from .worker import Failed, RequestSink, Submission

FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
IN_FLIGHT = 64  # inputs of one request queued in the engine at once (the rest follow as those end)
_GONE = object()  # put in a request's queue when its client goes away


def add_embeddings_route(app: FastAPI, generator: Any, worker: Any, names: ModelNames, settings: Any) -> None:
    """``worker``: the engine thread (serve/worker.py) the inputs run on."""
    if settings.embeddings is not None and generator.config.is_encoder_decoder:
        raise APIError(400, "--embeddings needs a decoder-only model (this one is an encoder-decoder)")
    context = names.context

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
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
        vectors = await embed_on_engine(worker, inputs, settings.embeddings, lifetime_of(request))
        if vectors is None:  # the client went away: nothing to answer
            return Response(status_code=499)
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, encoding)} for i, v in enumerate(vectors)]
        tokens = sum(len(i) for i in inputs)
        return {"object": "list", "data": data, "model": model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class EmbeddingSubmission(Submission):
    """One input to embed on the engine thread: an embedding sequence of the engine (no token)."""

    def __init__(self, index: int, prompt_ids: list[int], pooling: str, sink: RequestSink):
        super().__init__(index, prompt_ids, {}, sink, time.perf_counter())
        self.pooling = pooling

    def start(self, engine: Any) -> Any:
        return submit_embedding(engine, self.prompt_ids, self.pooling)


async def embed_on_engine(worker: Any, inputs: list[list[int]], pooling: str, lifetime: Any) -> list[Any] | None:
    """Each input's unit vector [C], from embedding sequences of ``worker``'s engine, at most
    ``IN_FLIGHT`` of this request queued at once (a request may hold more inputs than the engine's
    queue) -> None if the client went away (what it queued is cancelled); an APIError if the engine
    refuses one (a full queue...)."""
    sink = RequestSink(asyncio.get_running_loop())
    submissions = [EmbeddingSubmission(i, ids, pooling, sink) for i, ids in enumerate(inputs)]
    later = iter(submissions)

    def cancel() -> None:
        for submission in submissions:
            worker.cancel(submission)
        sink.queue.put_nowait(_GONE)

    lifetime.on_disconnect(cancel)
    for submission in itertools.islice(later, IN_FLIGHT):
        worker.submit(submission)
    left = len(submissions)
    while left:
        item = await sink.queue.get()
        if item is _GONE:
            return None
        if isinstance(item, Failed):
            cancel()
            raise item.error
        if getattr(item, "finish_reason", None) is not None:  # an embedding sequence's end
            left -= 1
            for submission in itertools.islice(later, 1):
                worker.submit(submission)
    return [submission.sequence.embedding for submission in submissions]


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


def _encode(vector: Any, encoding: str) -> list[float] | str:
    if encoding == "base64":  # little-endian float32, as OpenAI sends it
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
