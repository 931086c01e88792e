"""The speech server: OpenAI's ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``.

``create_speech_app(transcriber, settings)`` serves one Whisper model. A request is OpenAI's
multipart form (``file``, ``model``, ``language``, ``prompt``, ``temperature``,
``response_format`` = json | text | srt | vtt | verbose_json, ``timestamp_granularities[]``); the
upload is decoded as it streams from its spooled file. Every request's transcription runs on one
engine thread (``SpeechWorker``), side by side with the others: each round answers every open
transcription's next request in shared encoder batches and searches (speech/batching.py).
Errors are OpenAI error objects, as in app.py. The body is read up to ``max_body_bytes`` whether or
not it declares a Content-Length (body.py); a client that disconnects cancels its transcription
(lifetime.py: it leaves the engine before the next round).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import FastDecodeError, GenerationCancelledError
from .app import _Guard, add_error_handlers
from .body import read_body
from .lifetime import ConnectionLifetime, lifetime_of
from .metrics import ServerMetrics
from .protocol import APIError

log = logging.getLogger("fastdecode.serve")
FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class SpeechServeSettings:
    model_name: str = "whisper"
    api_key: str | None = None
    max_body_bytes: int = 25 << 20  # OpenAI's upload limit
    grace_seconds: float = 30.0
    # slow clients and open connections, as the text server's (serve/connections.py via server.uvicorn_config)
    header_timeout: float = 5.0
    body_timeout: float = 60.0  # an upload of 25 MB on a slow link
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024


class SpeechWorker:
    """The engine thread: new transcriptions join the batcher between rounds."""

    def __init__(self, transcriber):
        from ..speech.batching import WindowBatcher

        self.batcher = WindowBatcher(transcriber.model, transcriber.vocabulary)
        self.incoming: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="fastdecode-speech", daemon=True)
        self.stopping = False

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.incoming.put(None)
        self.thread.join(10)

    async def run(self, steps, cancelled=None) -> Any:
        """The transcription's result (or its error raised), computed on the engine thread; it
        stops (``GenerationCancelledError``) once ``cancelled()`` is true."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result) -> None:
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(result))

        self.incoming.put((steps, done, cancelled))
        result = await future
        if isinstance(result, BaseException):
            raise result
        return result

    def _loop(self) -> None:
        while not self.stopping:
            try:
                item = self.incoming.get(block=not self.batcher.open)
            except queue.Empty:
                item = ()
            while item:  # everything that arrived joins this round
                steps, done, cancelled = item
                self.batcher.add(steps, done, cancelled)
                try:
                    item = self.incoming.get_nowait()
                except queue.Empty:
                    item = ()
            if item is None:
                break
            try:
                self.batcher.round()
            except Exception as exc:  # noqa: BLE001 - a model failure ends the round's transcriptions, not the server
                log.exception("speech round failed")
                failed, self.batcher.open = self.batcher.open, []
                for open_ in failed:
                    open_.done(exc)


# The form fields each route takes (translations: no language, English is the target); any other is a 400.
FORM_FIELDS = {"transcribe": {"file", "model", "language", "prompt", "response_format", "temperature",
                              "timestamp_granularities[]", "timestamp_granularities"},
               "translate": {"file", "model", "prompt", "response_format", "temperature"}}


def _check_form_fields(form, task: str) -> None:
    """A 400 naming the first form field the route does not take (``stream`` only as false), never
    silently dropped: OpenAI's ``stream``, ``include[]``, ``chunking_strategy`` ask for what is not served."""
    for name in form.keys():
        if name in FORM_FIELDS[task] or (name == "stream" and form.get(name) in ("false", "False", "")):
            continue
        raise APIError(400, f"{name} is not supported by this route (it takes "
                            f"{', '.join(sorted(FORM_FIELDS[task]))})", param=name, code="unsupported_field")


def _field(form, name: str, kind: type, default: Any) -> Any:
    value = form.get(name)
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise APIError(400, f"{name} must be a form field, not a file", param=name, code="invalid_value")
    try:
        return kind(value)
    except ValueError:
        raise APIError(400, f"{name} must be a {kind.__name__}, got {value!r}", param=name,
                       code="invalid_value") from None


def create_speech_app(transcriber, settings: SpeechServeSettings | None = None) -> FastAPI:
    from contextlib import asynccontextmanager

    from ..speech.formats import render, verbose

    settings = settings or SpeechServeSettings()
    metrics = ServerMetrics()
    worker = SpeechWorker(transcriber)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="fastdecode speech", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.worker, app.state.settings = worker, settings
    app.add_middleware(ConnectionLifetime)
    app.add_middleware(_Guard, settings=settings, metrics=metrics)

    add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                            "created": int(time.time()), "owned_by": "fastdecode"}]}

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _answer(request, "transcribe")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _answer(request, "translate")

    async def _answer(request: Request, task: str) -> Response:
        # the whole body within the limit (a chunked upload declares no length: _Guard cannot check it);
        # Starlette's form parser then reads it from request._body, the cache of request.body()
        request._body = await read_body(request, settings.max_body_bytes)
        try:
            form = await request.form()
        except Exception as exc:  # noqa: BLE001 - starlette's multipart errors have several types
            raise APIError(400, f"the body must be a multipart form: {exc}", code="invalid_value") from exc
        _check_form_fields(form, task)
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form needs a 'file' with the audio", param="file", code="invalid_value")
        model = _field(form, "model", str, settings.model_name)
        if model not in (settings.model_name, "whisper-1"):
            raise APIError(404, f"the model {model!r} does not exist: this server serves {settings.model_name!r}",
                           param="model", code="model_not_found")
        response_format = _field(form, "response_format", str, "json")
        if response_format not in FORMATS:
            raise APIError(400, f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}",
                           param="response_format", code="invalid_value")
        granularities = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
        if any(g not in ("segment", "word") for g in granularities):
            raise APIError(400, f"timestamp_granularities must be 'segment' or 'word', got {granularities}",
                           param="timestamp_granularities", code="invalid_value")
        if "word" in granularities and response_format != "verbose_json":  # OpenAI's rule: words come in it only
            raise APIError(400, "timestamp_granularities word needs response_format verbose_json (the words are "
                                f"part of it), got {response_format!r}", param="timestamp_granularities",
                           code="invalid_value")
        temperature = _field(form, "temperature", float, 0.0)
        options = {"task": task, "language": None if task == "translate" else _field(form, "language", str, None),
                   "initial_prompt": _field(form, "prompt", str, None), "word_timestamps": "word" in granularities,
                   # OpenAI: 0 means "raise the temperature as Whisper's thresholds say"
                   "temperature": FALLBACK_TEMPERATURES if temperature == 0 else (temperature,)}
        try:
            opts = transcriber.options(**options)
            cancelled = threading.Event()
            lifetime_of(request).on_disconnect(cancelled.set)
            result = await worker.run(transcriber.steps(upload.file, opts), cancelled.is_set)
        except GenerationCancelledError:
            return Response(status_code=499)  # the client went away: nothing to answer
        except FastDecodeError as exc:
            raise APIError(400, str(exc), param="file" if "audio" in str(exc) else None, code="invalid_value") from exc
        finally:
            await upload.close()
        if response_format == "json":
            return JSONResponse({"text": result.text})
        if response_format == "verbose_json":
            return JSONResponse(verbose(result))
        return PlainTextResponse(render(result, response_format))

    return app


def run_speech_server(transcriber, host: str, port: int, settings: SpeechServeSettings) -> int:
    """Serve until SIGTERM / Ctrl-C (in-flight requests get ``grace_seconds``) -> the exit code, as
    ``fastdecode serve`` (server.serve_until_drained)."""
    from .server import serve_until_drained

    return serve_until_drained(create_speech_app(transcriber, settings), host, port)
