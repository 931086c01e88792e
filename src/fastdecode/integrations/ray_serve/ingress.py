"""The ingress deployment: the HTTP face of the service, in front of the model replicas.

It checks the API key and the body size (the single server's own request guard), answers CORS
(``allowed_origins``) and gives every response its ``x-request-id`` (sent on to the replica, so
both logs name a request alike), validates generation requests with the single server's parsers
(checks.py: a bad request is answered here, as ``fastdecode serve`` answers it, and never reaches
a replica), and forwards every request to a replica, whose copy of the application answers it.
/metrics and /health are the service's: each replica's answer, gathered.

A replica that dies while it holds a request: a request whose response has not started (any
non-streaming request, a streaming one before its first byte) is sent again, to another replica
(the router forgets the dead one); a stream that already started ends with an OpenAI ``error``
event, as a stream that fails inside ``fastdecode serve`` does. Never a hang: Ray reports the
dead actor to every caller waiting on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import RayActorError

from ...serve.anthropic_api import PATH as MESSAGES_PATH
from ...serve.anthropic_api import anthropic_error
from ...serve.app import _Guard, add_error_handlers
from ...serve.body import read_body
from ...serve.protocol import APIError
from ...serve.request_id import RequestId
from ...serve.service import ServeSettings
from .checks import RESPONSES_PATH, RequestChecks
from .forwarding import REPLICA_HEADER, ForwardedRequest, ReplicaIdentity, ResponseHead
from .metrics import IngressMetrics
from .registry import live_replicas

log = logging.getLogger("fastdecode.serve")

RETRY_BACKOFF_S = (0.1, 0.5, 1.0, 2.0)  # before each new try; one more try than failures survived
FAN_OUT_TIMEOUT_S = 5.0  # a replica that does not answer /metrics or /health in time is left out
SKIPPED_HEADERS = {b"content-length", b"transfer-encoding", b"connection", b"host"}
FORWARDED_SKIPPED = SKIPPED_HEADERS | {b"x-request-id"}  # the ingress's id is sent instead


def replica_lost(exc: BaseException) -> APIError:
    return APIError(503, f"the replica serving this request stopped before it finished ({type(exc).__name__}); "
                         f"send it again", "server_error", code="replica_unavailable", headers={"Retry-After": "1"})


@serve.ingress()
class Ingress:
    """The ingress deployment's class; ``model`` is the model deployment's handle."""

    def __init__(self, model: Any, settings: ServeSettings, retries: int = len(RETRY_BACKOFF_S)):
        self.model = model.options(stream=True)
        self.settings, self.retries = settings, retries
        self.checks = RequestChecks(settings)
        self.metrics = IngressMetrics()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self)

    # -- forwarding ------------------------------------------------------------------------------
    async def forward(self, request: Request) -> Response:
        body = await read_body(request, self.settings.max_body_bytes)
        headers = [(k, v) for k, v in request.scope["headers"] if k.lower() not in FORWARDED_SKIPPED]
        request_id = request.scope.get("state", {}).get("request_id")
        headers += [(b"x-request-id", request_id.encode())] if request_id else []
        forwarded = ForwardedRequest(request.method, request.url.path, request.scope.get("query_string", b""),
                                     headers + [(b"content-length", str(len(body)).encode())], body)
        forwarded.prompt, stream = self.checks.inspect(request.method, forwarded.path, body)
        return await self.respond(forwarded, stream)

    async def respond(self, forwarded: ForwardedRequest, stream: bool) -> Response:
        """The replica's response; sent again on another replica while nothing reached the client."""
        for attempt in range(self.retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S)) - 1])
            responses = self.model.handle.remote(forwarded)
            try:
                head: ResponseHead = await responses.__anext__()
                if stream and head.status == 200:
                    return _relay(head, responses, self.metrics, forwarded.path)
                body = b"".join([chunk async for chunk in responses])
            except RayActorError as exc:
                responses.cancel()
                self.metrics.replica_failures.inc()
                lost = exc
                continue
            except asyncio.CancelledError:  # the client went away: so does its generation
                responses.cancel()
                raise
            return _whole(head, body)
        raise replica_lost(lost)

    async def gather(self, path: str) -> list[tuple[ReplicaIdentity, bytes]]:
        """Each live replica's answer to ``GET path``; replicas that do not answer in time are left out.

        One replica after the other: calls made while serving one HTTP request share its Serve
        request id, and Ray 2.60's router matches a routed replica to its request by that id, so
        concurrent calls from one request could take each other's replica (and spin).
        """
        ids = live_replicas(self.model.app_name, self.model.deployment_name)
        if ids is None:  # the router is made by the handle's first request
            await self.respond(ForwardedRequest("GET", "/health"), stream=False)
            ids = live_replicas(self.model.app_name, self.model.deployment_name) or []
        answers = []
        for replica in ids:
            responses = self.model.handle.remote(ForwardedRequest("GET", path, replica=replica))
            try:
                answers.append(await asyncio.wait_for(_identity_and_body(responses), FAN_OUT_TIMEOUT_S))
            except Exception as exc:  # dead, busy or failing: left out, as a scrape target that is down
                log.warning("replica %s did not answer %s: %r", replica, path, exc)
                responses.cancel()
        return answers


async def _identity_and_body(responses: Any) -> tuple[ReplicaIdentity, bytes]:
    head: ResponseHead = await responses.__anext__()
    return head.identity, b"".join([chunk async for chunk in responses])


def _headers(head: ResponseHead) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in head.headers if k.lower() not in SKIPPED_HEADERS]
    return kept + [(REPLICA_HEADER.encode(), head.identity.replica.encode())]


def _whole(head: ResponseHead, body: bytes) -> Response:
    response = Response(body, status_code=head.status)
    response.raw_headers = _headers(head) + [(b"content-length", str(len(body)).encode())]
    return response


def _event(error: APIError, path: str) -> bytes:
    """The event that ends a stream with ``error``, in the stream's API: Anthropic's on /v1/messages,
    the Responses API's ``error`` event on /v1/responses, else an OpenAI error object."""
    if path == MESSAGES_PATH:
        return f"event: error\ndata: {json.dumps(anthropic_error(error))}\n\n".encode()
    if path == RESPONSES_PATH:
        data = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
        return f"event: error\ndata: {json.dumps(data)}\n\n".encode()
    return f"data: {json.dumps(error.body())}\n\n".encode()


def _internal(exc: Exception) -> APIError:
    return APIError(500, f"internal error: {exc}", "server_error", code="internal_error")


def _relay(head: ResponseHead, responses: Any, metrics: IngressMetrics, path: str) -> StreamingResponse:
    """The replica's stream, chunk by chunk; if the replica dies mid-stream, an ``error`` event ends it."""

    async def chunks() -> AsyncIterator[bytes]:
        finished = False
        try:
            async for chunk in responses:
                yield chunk
            finished = True
        except RayActorError as exc:
            metrics.replica_failures.inc()
            yield _event(replica_lost(exc), path)
        except Exception as exc:  # a bug on the replica's side: answered, as the app answers its own
            yield _event(_internal(exc), path)
        finally:
            if not finished:
                responses.cancel()  # the client went away or the replica failed: stop generating

    response = StreamingResponse(chunks(), status_code=head.status)
    response.raw_headers = _headers(head)
    return response


def build_app(ingress: Ingress) -> FastAPI:
    """The ingress's ASGI app: the single server's guard, CORS, request ids and error answers, the
    gathered routes, and forwarding."""
    settings, metrics = ingress.settings, ingress.metrics
    app = FastAPI(title="fastdecode on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_Guard, settings=settings, metrics=metrics)
    if settings.allowed_origins:  # outside the key check, as the single server: a preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"], max_age=600)
    app.add_middleware(RequestId)
    add_error_handlers(app)  # OpenAI's error object (Anthropic's shape on /v1/messages)

    @app.get("/metrics")
    async def prometheus() -> Response:
        replicas = {identity.replica: body.decode("utf-8") for identity, body in await ingress.gather("/metrics")}
        return Response(metrics.render(replicas), media_type=metrics.content_type)

    @app.get("/health")
    async def health() -> JSONResponse:
        """The service is up while one replica answers; each replica is listed with where it runs."""
        replicas = [{"replica": identity.replica, "node": identity.node, "pid": identity.pid,
                     "running_sequences": json.loads(body).get("running_sequences", 0)}
                    for identity, body in await ingress.gather("/health")]
        body = {"status": "ok" if replicas else "unavailable", "model": settings.model_name,
                "replicas": len(replicas), "running_sequences": sum(r["running_sequences"] for r in replicas),
                "by_replica": replicas}
        return JSONResponse(body, status_code=200 if replicas else 503)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"])
    async def forward(request: Request) -> Response:
        return await ingress.forward(request)

    return app
