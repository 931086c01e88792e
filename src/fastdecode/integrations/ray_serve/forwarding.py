"""What travels between the ingress and a model replica, and the replica's side of the trip.

The ingress sends a ``ForwardedRequest`` (the HTTP request as plain data, plus the text the router
matches prefixes on); the replica runs it through the same ASGI application ``fastdecode serve``
runs (``call_app``) and streams back a ``ResponseHead`` and then the body's bytes as the
application sends them. No handler is written twice: the replica's app parses, validates,
generates and builds every response object.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

REPLICA_HEADER = "x-fastdecode-replica"  # which replica answered: a conversation's turns show where they ran
GENERATION_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


@dataclass
class ForwardedRequest:
    """One HTTP request for a replica. ``prompt`` is the text PrefixCacheAffinityRouter matches
    (its contract: an argument with a ``prompt`` attribute); None routes by load alone.
    ``replica``: send to this replica only (the ingress asks each replica for its metrics)."""

    method: str
    path: str
    query_string: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""
    prompt: str | None = None
    replica: str | None = None


@dataclass(frozen=True)
class ReplicaIdentity:
    """Which replica answered, and where its process runs (for operators: logs, profilers, kill)."""

    replica: str  # Serve's replica id
    node: str  # the node's IP address
    pid: int


@dataclass
class ResponseHead:
    """The first item a replica streams back: status, headers, and who answered."""

    status: int
    headers: list[tuple[bytes, bytes]]
    identity: ReplicaIdentity


def routing_text(endpoint: str, prompts: list[Any]) -> str | None:
    """The text that identifies a request's prompt prefix, or None when there is none to match.

    Chat: each message's content then its role, in order, so that a conversation's next turn
    starts with its previous turn's text and two conversations part at their first words;
    completions: the first prompt (token ids as decimal words).
    """
    if not prompts:
        return None
    first = prompts[0]
    if endpoint == "chat":
        parts = []
        for message in first:
            content = message.get("content")
            text = content if isinstance(content, str) else json.dumps(content, sort_keys=True, ensure_ascii=False)
            parts.append(f"{text}\x1f{message.get('role')}\x1e")
        text = "".join(parts)
    elif isinstance(first, str):
        text = first
    else:
        text = "".join(f"{token} " for token in first)
    return text or None


class HostedApp:
    """An ASGI application run without a server: its startup and shutdown as uvicorn runs them
    (the app's lifespan: fastdecode's engine thread), and requests through ``call_app``."""

    def __init__(self, app: Any):
        from uvicorn.config import Config
        from uvicorn.lifespan.on import LifespanOn

        self.app = app
        self._lifespan = LifespanOn(Config(app, lifespan="on", log_config=None))

    async def start(self) -> None:
        await self._lifespan.startup()
        if self._lifespan.should_exit:
            raise RuntimeError("the fastdecode application failed to start (see the log)")

    async def stop(self) -> None:
        await self._lifespan.shutdown()

    def handle(self, request: ForwardedRequest, identity: ReplicaIdentity) -> AsyncIterator[ResponseHead | bytes]:
        return call_app(self.app, request, identity)


async def call_app(app: Any, request: ForwardedRequest,
                   identity: ReplicaIdentity) -> AsyncIterator[ResponseHead | bytes]:
    """Run ``request`` through the ASGI ``app``; yield its head, then each body chunk as sent.

    Closing the iterator early (the client went away, the ingress cancelled) tells the app the
    client disconnected and cancels it, as uvicorn does for a closed connection.
    """
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": request.method, "scheme": "http", "path": request.path,
             "raw_path": request.path.encode("latin-1"), "query_string": request.query_string, "root_path": "",
             "headers": request.headers, "client": None, "server": None}
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_read = False
    finished = object()

    async def receive() -> dict[str, Any]:
        nonlocal body_read
        if not body_read:
            body_read = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(finished)

    task = asyncio.create_task(run())
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # an error is read, never logged twice
    started = False
    try:
        while True:
            message = await messages.get()
            if message is finished:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
                break
            if message["type"] == "http.response.start":
                started = True
                yield ResponseHead(message["status"], list(message.get("headers", [])), identity)
            elif message["type"] == "http.response.body" and started:
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        if not task.done():
            task.cancel()
