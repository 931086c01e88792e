"""A generation request's body -> the validated ``GenerationRequest``, without the engine: what
/v1/completions and /v1/chat/completions check before they submit (app.py), and what the Ray
Serve ingress checks before it forwards (integrations/ray_serve/checks.py), so both answer a bad
request alike."""

from __future__ import annotations

from typing import Any

from .extras import apply_extras, parse_extras
from .fields import check_fields
from .names import ModelNames
from .protocol import GenerationRequest, parse_request


def parse_generation(body: dict[str, Any], endpoint: str, names: ModelNames,
                     lenient: bool) -> tuple[GenerationRequest, str, dict[str, Any]]:
    """-> (the request, the model name it is answered as, the body with vendor extras applied);
    raises APIError naming the bad field (or 404 for another model with ``names.strict``)."""
    check_fields(body, endpoint, lenient)
    body = apply_extras(body)
    served = names.resolve(body.get("model"))
    parsed = parse_request({**body, "model": served} if isinstance(body.get("model"), str) else body, endpoint,
                           served)
    parse_extras(body, parsed)
    return parsed, served, body


def parse_translated_chat(chat_body: dict[str, Any], model: str) -> GenerationRequest:
    """A chat body another API's route translated (/v1/responses, /v1/messages: adapters.py) ->
    the validated request, as /v1/chat/completions validates its own."""
    parsed = parse_request(chat_body, "chat", model)
    parse_extras(chat_body, parsed)
    return parsed
