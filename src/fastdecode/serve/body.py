"""The one reader and parser of request bodies: every way a body can be bad is the client's error.

``read_json_body`` reads at most ``limit`` bytes (also for chunked uploads that declare no length)
and parses them as a JSON object. Whatever the parser raises (bad syntax, bad UTF-8, an integer
past Python's digit limit, nesting deeper than the recursion limit) is a 400 naming the problem,
never a 500.
"""

from __future__ import annotations

import json
from typing import Any

from .protocol import APIError


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", param=None, code="request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a Starlette ``request``, read up to ``limit`` bytes."""
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection before sending the whole body",
                       code="incomplete_body") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; any parsing failure is an APIError 400 naming what went wrong."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError:
        raise APIError(400, "the request body is not usable JSON: it is nested too deeply",
                       code="invalid_json") from None
    except Exception as exc:  # e.g. ValueError "Exceeds the limit (4300 digits) for integer string conversion"
        raise APIError(400, f"the request body is not usable JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


async def read_json_body(request: Any, limit: int) -> dict[str, Any]:
    return parse_json_object(await read_body(request, limit))
