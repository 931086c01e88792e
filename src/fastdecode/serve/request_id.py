"""An ``x-request-id`` header on every response (errors, streams and 404s included): the client's
own when it sent one (up to 128 printable ASCII characters), else a fresh random id; the same id
is in the server's log line for a failed request. Pure ASGI, so streams pass through untouched."""

from __future__ import annotations

import uuid
from typing import Any

MAX_ID_LENGTH = 128


class RequestId:
    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        sent = dict(scope["headers"]).get(b"x-request-id", b"")
        usable = 0 < len(sent) <= MAX_ID_LENGTH and all(0x20 < c < 0x7F for c in sent)
        request_id = sent if usable else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
