"""The model names a server answers to: ``--served-model-name`` (several aliases allowed; the first
is the one responses carry). A server with one model answers any name, as llama.cpp's does (clients
such as LangChain's ``ChatOpenAI()`` send ``gpt-3.5-turbo`` by default), unless
``--strict-model-name``: then another name is a 404."""

from __future__ import annotations

import time
from typing import Any

from .protocol import APIError


class ModelNames:
    def __init__(self, names: list[str], strict: bool, context: int):
        self.names, self.strict, self.context = names, strict, context
        self.created = int(time.time())

    @property
    def primary(self) -> str:
        return self.names[0]

    def resolve(self, requested: Any) -> str:
        """The name a request's ``model`` field answers to (its own when it is an alias, else the
        primary one); 404 for another name with ``strict``. A non-string is left to the parser."""
        if requested is None or not isinstance(requested, str) or requested in self.names:
            return requested if isinstance(requested, str) else self.primary
        if self.strict:
            raise APIError(404, f"the model {requested!r} does not exist: this server serves "
                                f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")
        return self.primary

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "fastdecode",
                "max_model_len": self.context}

    def listing(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.card(name) for name in self.names]}

    def retrieve(self, name: str) -> dict[str, Any]:
        """``GET /v1/models/{name}``: the card of an alias (any name unless strict, as requests)."""
        if name not in self.names and self.strict:
            raise APIError(404, f"the model {name!r} does not exist: this server serves "
                                f"{', '.join(map(repr, self.names))}", param="model", code="model_not_found")
        return self.card(name if name in self.names else self.primary)
