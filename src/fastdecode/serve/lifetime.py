"""A request's lifetime follows its connection: the one place where a client going away cancels
what its request runs, for every route (engine, beam search, streaming cache) and both answers
(streamed or whole).

``ConnectionLifetime`` (pure ASGI middleware) gives each HTTP request a ``Lifetime``. Once a
handler has read the body it calls ``on_disconnect(cancel)``: a task then waits on the
connection's ``receive`` for ``http.disconnect`` and calls ``cancel`` at once (not when the next
token is ready to be written, nor after a polling period). The task ends with the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

SCOPE_KEY = "fastdecode.lifetime"


class Lifetime:
    def __init__(self, receive: Callable[[], Any]):
        self._receive = receive
        self._callbacks: list[Callable[[], None]] = []
        self._watcher: asyncio.Task | None = None
        self.disconnected = False

    def on_disconnect(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the client closes the connection (soon, if it already has).
        Only after the body was read: from then on the watcher owns ``receive``."""
        self._callbacks.append(callback)
        if self.disconnected:
            callback()
        elif self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass  # a body's trailing empty message: the request is read already
        self.disconnected = True
        for callback in self._callbacks:
            callback()

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


class ConnectionLifetime:
    """ASGI middleware: a ``Lifetime`` per HTTP request (``lifetime_of(request)``), closed with it."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lifetime = scope[SCOPE_KEY] = Lifetime(receive)
        try:
            await self.app(scope, receive, send)
        finally:
            lifetime.close()


def lifetime_of(request: Any) -> Lifetime:
    return request.scope[SCOPE_KEY]
