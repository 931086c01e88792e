"""The FastAPI application: OpenAI routes, the chat page, health and metrics.

``create_app(generator, settings)`` builds a server around one loaded model; tests build one
in-process on a free loopback port. Handlers only parse, submit and relay: the engine runs on its
own thread (``worker.py``).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from .anthropic_api import PATH as MESSAGES_PATH
from .anthropic_api import add_messages_route, anthropic_error
from .body import read_json_body, too_large
from .echo import EchoedPrompt, echo_chunk, echoed_prompts, prepend_echo
from .embeddings import add_embeddings_route
from .extras import best_choices
from .lifetime import ConnectionLifetime, lifetime_of
from .metrics import ServerMetrics
from .names import ModelNames
from .parsing import parse_generation
from .request_id import RequestId
from .responses_api import add_responses_route
from .protocol import APIError, GenerationRequest
from .responses import ChoiceState, ResponseBuilder
from .service import GenerationService, RunningRequest, ServeSettings
from .utility_routes import TOKEN_ROUTES, add_token_routes
from .structured import attach_constraints
from .tool_calls import ToolCallParser, parse_tool_calls

log = logging.getLogger("fastdecode.serve")
VENDORED = {"marked.umd.js": "text/javascript", "purify.min.js": "text/javascript",
            "marked.LICENSE.txt": "text/plain", "dompurify.LICENSE.txt": "text/plain"}


def create_app(generator: Any, settings: ServeSettings | None = None) -> FastAPI:
    settings = settings or ServeSettings()
    metrics = ServerMetrics()
    service = GenerationService(generator, settings, metrics)
    # redirect_slashes off: Starlette would answer "/v1/completions/" with a redirect built from the
    # Host header (an open redirect); an unknown path is a 404 error object instead.
    app = FastAPI(title="fastdecode", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_lifespan(service), redirect_slashes=False)
    app.state.service, app.state.settings, app.state.metrics = service, settings, metrics

    names = ModelNames([settings.model_name, *settings.model_aliases], settings.strict_model_name, service.context)
    app.state.names = names
    app.add_middleware(ConnectionLifetime)
    app.add_middleware(_Guard, settings=settings, metrics=metrics)
    if settings.allowed_origins:  # outside the key check: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"], max_age=600)
    app.add_middleware(RequestId)

    add_error_handlers(app)

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(resources.files("fastdecode.serve").joinpath("static/chat.html").read_text("utf-8"))

    @app.get("/static/vendor/{name}")
    async def vendored(name: str) -> Response:  # the page's libraries (static/vendor/README.md), a fixed list
        if name not in VENDORED:
            raise APIError(404, f"no route GET /static/vendor/{name}", code="not_found")
        text = resources.files("fastdecode.serve").joinpath(f"static/vendor/{name}").read_text("utf-8")
        return Response(text, media_type=VENDORED[name], headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": settings.model_name,
                "running_sequences": service.active_sequences()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return names.listing()

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        return names.retrieve(name)

    add_token_routes(app, generator, settings.max_body_bytes)
    add_embeddings_route(app, generator, service.worker, names, settings)
    add_messages_route(app, service, names, settings)
    add_responses_route(app, service, names, settings)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    async def _generate(request: Request, endpoint: str) -> Response:
        body = await read_json_body(request, settings.max_body_bytes)
        parsed, served, body = parse_generation(body, endpoint, names, settings.lenient)
        attach_constraints(parsed, body)
        prompts = service.encode(parsed)
        echoed = await echoed_prompts(service.worker, generator, prompts, parsed.logprobs) if parsed.echo else None
        running = await service.start_request(parsed, prompts)
        lifetime_of(request).on_disconnect(running.cancel)  # every route, streamed or not
        builder = ResponseBuilder(endpoint, served, generator.tokenizer, parsed.logprobs)
        if parsed.stream:
            return StreamingResponse(_sse(running, parsed, builder, echoed), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices = {i: ChoiceState(i) for i in range(len(running.prompt_lengths) * parsed.candidates)}
        async for piece in running.pieces():
            choices[piece.index].add(piece)
        if running.cancelled:  # the client went away: nothing to answer
            return Response(status_code=499)
        ordered = [choices[i] for i in sorted(choices)]
        if parsed.candidates > parsed.n:
            ordered = best_choices(ordered, parsed.n, parsed.candidates)
        if echoed is not None:
            prepend_echo(ordered, echoed, parsed.n)
        if parsed.tools is not None and parsed.tools.parses_output:
            for choice in ordered:
                content, calls = parse_tool_calls(choice.text, parsed.tools.names)
                if calls:
                    choice.text, choice.tool_calls, choice.finish_reason = content or "", calls, "tool_calls"
        return JSONResponse(builder.response(ordered, _prompt_counts(ordered, running, parsed.n)))

    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error answered as an OpenAI error object (also used by the speech app, audio.py)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path == MESSAGES_PATH:  # Anthropic's clients read Anthropic's error shape
            return JSONResponse(anthropic_error(exc), status_code=exc.status, headers=exc.headers)
        return _error_response(exc)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc: Exception) -> JSONResponse:
        return _error_response(APIError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    @app.exception_handler(405)
    async def not_allowed(request: Request, _exc: Exception) -> JSONResponse:
        return _error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}",
                                        code="method_not_allowed"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # answered outside the middleware stack (Starlette's outermost layer): the request id is added here
        request_id = request.scope.get("state", {}).get("request_id", "")
        log.exception("unhandled error (request %s)", request_id)
        return _error_response(APIError(500, f"internal error: {exc}", "server_error", code="internal_error",
                                        headers={"x-request-id": request_id} if request_id else None))


async def _sse(running: RunningRequest, request: GenerationRequest, builder: ResponseBuilder,
               echoed: list[EchoedPrompt] | None) -> AsyncIterator[str]:
    """Server-sent events: one ``data: {chunk}`` per piece, usage if asked, then ``data: [DONE]``.
    An error after the stream started is sent as an ``error`` object, then the stream ends.
    (A streamed request has as many candidates as choices: best_of > n is refused.)"""
    choices = {i: ChoiceState(i) for i in range(len(running.prompt_lengths) * request.n)}
    try:
        for index in sorted(choices):
            first = builder.first_chunk(index) if echoed is None else echo_chunk(builder, index,
                                                                                 echoed[index // request.n])
            if first is not None:
                yield _event(first)
        tool_parsers = ({i: ToolCallParser(request.tools.names) for i in choices}
                        if request.tools is not None and request.tools.parses_output else None)
        async for piece in running.pieces():
            choices[piece.index].add(piece)
            if tool_parsers is not None:
                for chunk in _tool_chunks(builder, tool_parsers[piece.index], piece):
                    yield _event(chunk)
            elif piece.text or piece.finish_reason is not None or request.logprobs is not None:
                yield _event(builder.piece_chunk(piece))
    except APIError as exc:
        yield _event(exc.body())
        return
    finally:
        running.cancel()  # the client went away (the response task was cancelled): free its sequences now
    if request.include_usage:
        ordered = [choices[i] for i in sorted(choices)]
        yield _event(builder.usage_chunk(ordered, _prompt_counts(ordered, running, request.n)))
    yield "data: [DONE]\n\n"


def _tool_chunks(builder: ResponseBuilder, parser: ToolCallParser, piece: Any) -> list[dict]:
    """A streamed choice of a request with tools: its content and tool-call deltas as they are read
    (serve/tool_calls.py), then at its end the finish reason ("tool_calls" once a call was sent)."""
    deltas = parser.feed(piece.text)
    if piece.finish_reason is not None:
        deltas += parser.finish()
    chunks = [builder.delta_chunk(piece.index, delta) for delta in deltas]
    if piece.finish_reason is not None:
        chunks.append(builder.text_chunk(piece.index, "", parser.finish_reason(piece.finish_reason)))
    return chunks


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _prompt_counts(choices: list[ChoiceState], running: RunningRequest, n: int) -> list[tuple[int, int]]:
    """(prompt tokens, of which served from cache) per prompt, as its first choice's sequence saw them
    (a continued streaming conversation counts what its cache consumed, not a re-tokenization)."""
    return [(choices[p * n].prompt_tokens or length, choices[p * n].cached_tokens)
            for p, length in enumerate(running.prompt_lengths)]


def _lifespan(service: GenerationService):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.start()
        try:
            yield
        finally:
            service.stop()

    return lifespan


class _Guard:
    """Pure ASGI middleware (streams and disconnects pass through untouched): API key and declared
    body size before the route runs, and the request counter by endpoint and status."""

    def __init__(self, app: Any, settings: ServeSettings, metrics: ServerMetrics):
        self.app, self.settings, self.metrics = app, settings, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_and_record(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            keyed = scope["path"].startswith("/v1/") or scope["path"] in TOKEN_ROUTES
            if keyed and self.settings.api_key is not None and scope["method"] != "OPTIONS":
                _check_key(headers.get("authorization", ""), headers.get("x-api-key"), self.settings.api_key)
            if scope["method"] == "POST":
                _check_declared_size(headers.get("content-length"), self.settings.max_body_bytes)
        except APIError as exc:
            await _error_response(exc)(scope, receive, send_and_record)
        else:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.requests.labels(endpoint=_endpoint_label(scope["path"]), status=str(status["code"])).inc()


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _check_key(authorization: str, api_key_header: str | None, key: str) -> None:
    """``Authorization: Bearer <key>`` (OpenAI's clients) or ``x-api-key: <key>`` (Anthropic's)."""
    bearer = hmac.compare_digest(authorization.encode(), f"Bearer {key}".encode())
    if not bearer and not hmac.compare_digest((api_key_header or "").encode(), key.encode()):
        raise APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                            "(or 'x-api-key: <key>')", "authentication_error", code="invalid_api_key")


def _check_declared_size(declared: str | None, limit: int) -> None:
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)


def _endpoint_label(path: str) -> str:
    known = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/messages", "/v1/responses", "/v1/models", "/health", "/v1/health", "/metrics", "/",
             *TOKEN_ROUTES)
    return path if path in known else "other"
