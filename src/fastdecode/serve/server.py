"""Running the app under uvicorn: SIGTERM / Ctrl-C stop accepting, let in-flight requests finish
(at most ``grace_seconds``), then exit 0."""

from __future__ import annotations

import gc
import signal
from typing import Any

from ..errors import InvalidOptionError


def run(generator: Any, host: str, port: int, **settings: Any) -> int:
    try:
        import uvicorn  # noqa: F401 - the serve extra is installed (serve_until_drained runs it)

        from .app import create_app
        from .protocol import APIError
        from .service import ServeSettings
    except ImportError as exc:
        raise InvalidOptionError(f"fastdecode serve needs the serve extra: pip install 'fastdecode[serve]' ({exc})")
    try:
        app = create_app(generator, ServeSettings(**settings))
    except APIError as exc:
        raise InvalidOptionError(exc.message) from exc
    freeze_startup_heap()
    return serve_until_drained(app, host, port)


def freeze_startup_heap() -> int:
    """Move what start-up left (modules, the model's Python objects: ~170,000 after loading the
    embedded model) out of the garbage collector's sight -> how many objects it froze.

    The server process is ours and these live until it exits; left tracked, every full collection
    walks them again (~70 ms on one Zen 5 core), a pause in the middle of streaming requests."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve_until_drained(app: Any, host: str, port: int) -> int:
    """Serve ``app`` (its ``state.settings``: see ``uvicorn_config``) until SIGTERM / Ctrl-C, in-flight
    requests drained -> the exit code: 0 once drained, 1 if it never started."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(app, host, port, log_level="info"))
    # uvicorn drains on SIGTERM, then raises the signal again under the handler it found: make that
    # one a no-op so that a drained server exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1


def uvicorn_config(app: Any, host: str, port: int, log_level: str = "info") -> Any:
    """uvicorn's settings for an app built by ``create_app``: its ServeSettings' timeouts and limits
    (the header / body deadlines and the connection bound through connections.py's protocol)."""
    import uvicorn

    from .connections import ConnectionLimits, guarded_protocol

    settings = app.state.settings
    limits = ConnectionLimits(settings.header_timeout, settings.body_timeout, settings.max_connections)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=guarded_protocol(limits),
                          timeout_keep_alive=settings.keep_alive_timeout,
                          timeout_graceful_shutdown=settings.grace_seconds)
