"""fastdecode's OpenAI-compatible HTTP server (the ``serve`` extra: FastAPI + uvicorn).

``create_app(generator, settings)`` builds the application; ``fastdecode serve`` runs it. Importing
this package stays light: FastAPI is imported only when an app is built.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "ServeSettings"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .app import create_app

        return create_app
    if name == "ServeSettings":
        from .service import ServeSettings

        return ServeSettings
    raise AttributeError(name)
