"""Running the app under uvicorn: SIGTERM / Ctrl-C stop accepting, let in-flight requests finish
(at most ``grace_seconds``), then exit 0."""

from __future__ import annotations

import signal
from typing import Any

from ..errors import InvalidOptionError


def run(generator: Any, host: str, port: int, **settings: Any) -> int:
    try:
        import uvicorn

        from .app import create_app
        from .protocol import APIError
        from .service import ServeSettings
    except ImportError as exc:
        raise InvalidOptionError(f"fastdecode serve needs the serve extra: pip install 'fastdecode[serve]' ({exc})")
    try:
        app = create_app(generator, ServeSettings(**settings))
    except APIError as exc:
        raise InvalidOptionError(exc.message) from exc
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=settings.get("grace_seconds", 30.0))
    server = uvicorn.Server(config)
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: make that
    # one a no-op so that a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
