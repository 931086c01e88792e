"""Connection limits uvicorn does not have: a bounded time to receive a request's headers and its
body, and a bound on open connections.

uvicorn 0.54 (h11) bounds the header size (``h11_max_incomplete_event_size``) and an idle
keep-alive connection (``timeout_keep_alive``), but a client may take forever to send headers or a
body shorter than its ``Content-Length``, and ``limit_concurrency`` is only checked once a whole
request head has arrived, which a slow client never sends. ``guarded_protocol(limits)`` is uvicorn's
h11 protocol with three additions:

* a new connection over ``max_connections`` is answered 503 (+ Retry-After) and closed at once;
* a request whose head has started (or a new connection) must complete its headers within
  ``header_timeout`` seconds, and then its body within ``body_timeout``; past either the client
  gets 408 and the connection is closed (a handler waiting on the body sees a disconnect). A new
  connection that sent nothing is closed without an answer (nothing to answer to).

The timers follow h11's view of the client (``their_state``) after every chunk received.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("fastdecode.serve")


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 5.0  # seconds from a request's first byte to its last header line
    body_timeout: float = 10.0  # seconds from the last header line to the body's last byte
    max_connections: int = 1024  # open connections; the next one gets 503


def _raw_error(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 error response (OpenAI error object), written before or instead of h11's."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_busy", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode("latin-1") + body


class _GuardedH11Protocol(H11Protocol):
    limits: ConnectionLimits = ConnectionLimits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: Any = None
        self._phase: str | None = None
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection: %d open (--max-connections)", len(self.connections) - 1)
            transport.write(_raw_error(503, "Service Unavailable",
                                       f"the server has {self.limits.max_connections} open connections, its limit: "
                                       "retry later", "too_many_connections", "retry-after: 1\r\n"))
            transport.close()
            return
        self._follow_client(fresh=True)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_client()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _follow_client(self, fresh: bool = False) -> None:
        """The deadline for what the client is sending now: its head (a new connection, or bytes of
        a next request), its body, or none (a request complete, or an idle keep-alive connection,
        which uvicorn's own keep-alive timeout closes)."""
        state = self.conn.their_state
        if state is h11.IDLE and (fresh or self.conn.trailing_data[0]):
            self._set_deadline("headers")
        elif state is h11.SEND_BODY:
            self._set_deadline("body")
        elif state is not h11.IDLE:
            self._set_deadline(None)

    def _set_deadline(self, phase: str | None) -> None:
        if phase == getattr(self, "_phase", None):
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._phase, self._deadline = phase, None
        if phase is not None:
            seconds = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
            self._deadline = self.loop.call_later(seconds, self._expire, phase, seconds)

    def _expire(self, phase: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        log.info("closed a connection whose request %s took longer than %g s", phase, seconds)
        started = phase == "body" or bool(self.conn.trailing_data[0])  # a connection that sent nothing: no answer
        if started and (self.cycle is None or not self.cycle.response_started):
            option = "--header-timeout" if phase == "headers" else "--body-timeout"
            self.transport.write(_raw_error(408, "Request Timeout",
                                            f"the request {phase} did not arrive within {seconds:g} s ({option})",
                                            "request_timeout"))
        if self.cycle is not None:  # a handler reading the body sees the client gone; its answer goes nowhere
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` (pass it as ``uvicorn.Config(http=...)``)."""
    return type("GuardedH11Protocol", (_GuardedH11Protocol,), {"limits": limits})
