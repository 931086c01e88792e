"""What the ingress reads from a request before it forwards it, with the single server's own
parsers (no model: a bad request is answered here, as ``fastdecode serve`` answers it, and never
reaches a replica): whether the response streams, and the text the prefix router matches.

Generation routes: /v1/completions and /v1/chat/completions (serve/parsing.py), /v1/responses
and /v1/messages (translated into the chat body their routes run). Every other route
(/v1/embeddings, /tokenize, /detokenize, /v1/models/{id}, ...) needs the model's tokenizer or
nothing at all to check: the replica answers it, by load. Importing this module does not import Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...serve.anthropic_api import PATH as MESSAGES_PATH
from ...serve.anthropic_api import messages_chat_body
from ...serve.body import parse_json_object
from ...serve.names import ModelNames
from ...serve.parsing import parse_generation, parse_translated_chat
from ...serve.protocol import GenerationRequest
from ...serve.responses_api import responses_chat_body
from ...serve.service import ServeSettings
from .forwarding import GENERATION_PATHS, routing_text

Translator = Callable[[dict[str, Any], ModelNames, bool], tuple[dict[str, Any], str]]
RESPONSES_PATH = "/v1/responses"
TRANSLATED_PATHS: dict[str, Translator] = {RESPONSES_PATH: responses_chat_body, MESSAGES_PATH: messages_chat_body}


class RequestChecks:
    def __init__(self, settings: ServeSettings):
        # the model's context only shows in /v1/models cards, which the replicas answer
        self.names = ModelNames([settings.model_name, *settings.model_aliases], settings.strict_model_name, 0)
        self.lenient = settings.lenient

    def inspect(self, method: str, path: str, body: bytes) -> tuple[str | None, bool]:
        """(the routing text or None, whether the response streams); raises APIError for a bad request."""
        if method != "POST":
            return None, False
        parsed = self.parse(path, body)
        if parsed is None:
            return None, False
        return routing_text(parsed.endpoint, parsed.prompts), parsed.stream

    def parse(self, path: str, body: bytes) -> GenerationRequest | None:
        """The generation request a POST to ``path`` makes (None for other routes)."""
        if path in GENERATION_PATHS:
            return parse_generation(parse_json_object(body), GENERATION_PATHS[path], self.names, self.lenient)[0]
        if path in TRANSLATED_PATHS:
            chat_body, model = TRANSLATED_PATHS[path](parse_json_object(body), self.names, self.lenient)
            return parse_translated_chat(chat_body, model)
        return None
