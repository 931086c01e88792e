"""OpenAI request bodies -> validated generation requests, and OpenAI error objects.

Bodies are checked by hand (not by a schema library) so that every bad field gives a 400 whose
``param`` names the field and whose message says what was expected. Which fields an endpoint
accepts at all is fields.py's concern; the vLLM-style extras (best_of, echo, suffix, ...) are
parsed in extras.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import FastDecodeError, PromptTooLongError, QueueFullError
from ..validation import is_int

MAX_CHOICES = 16  # n per request
MAX_STOPS = 4  # OpenAI's limit on stop strings
MAX_TOP_LOGPROBS = {"completion": 5, "chat": 20}  # OpenAI's limits


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def api_error_from(exc: FastDecodeError) -> APIError:
    """A typed engine error -> the HTTP error a client sees (503 + Retry-After for a full queue)."""
    if isinstance(exc, QueueFullError):
        return APIError(503, str(exc), "server_busy", code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), param="messages", code="context_length_exceeded")
    return APIError(400, str(exc), param=getattr(exc, "option", None), code="invalid_value")


@dataclass
class GenerationRequest:
    """One validated /v1/completions or /v1/chat/completions request."""

    endpoint: str  # "completion" or "chat"
    model: str
    prompts: list[Any]  # completion: str or token-id lists; chat: one list of messages
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # GenerationConfig options (HF names)
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the k best
    user: str | None = None
    tools: Any = None  # serve/tools.py ToolRequest (chat with tools), or None
    constraint_field: str | None = None  # the body field that set options["response_format"]
    best_of: int | None = None  # sampled candidates per choice (the n best by cumulative logprob are answered)
    echo: bool = False  # completions: the prompt is part of each choice (and of its logprobs)
    suffix: str | None = None  # completions: fill in the middle between the prompt and this
    prediction: str | None = None  # the expected output (OpenAI's predicted outputs): drafts tokens from it

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt: best_of when it samples more than n, else n."""
        return self.best_of if self.best_of and not self.is_beam else self.n

    @property
    def is_beam(self) -> bool:
        return self.options.get("num_beams", 1) > 1


def parse_request(body: dict[str, Any], endpoint: str, served_model: str) -> GenerationRequest:
    """Validate a body; raise APIError (400, or 404 for an unknown model) naming the bad field."""
    fields = _Fields(body)
    model = fields.get("model", str, default=served_model)
    if model != served_model:
        raise APIError(404, f"the model {model!r} does not exist: this server serves {served_model!r}",
                       param="model", code="model_not_found")
    prompts = _completion_prompts(fields) if endpoint == "completion" else [_messages(fields)]
    request = GenerationRequest(endpoint, model, prompts)
    request.n = fields.integer("n", 1, low=1, high=MAX_CHOICES)
    request.stream = fields.get("stream", bool, default=False)
    request.include_usage = _include_usage(fields, request.stream)
    request.user = fields.get("user", str, default=None)
    request.logprobs = _logprobs(fields, endpoint)
    request.options = _options(fields, request.n)
    if request.is_beam and request.logprobs is not None:
        raise APIError(400, "logprobs are not available with beam search (num_beams > 1)", param="logprobs")
    return request


def _include_usage(fields: "_Fields", stream: bool) -> bool:
    """``stream_options`` (only with ``stream: true``, as OpenAI): ``include_usage`` a bool, and
    ``include_obfuscation`` only false (no obfuscation field is sent); any other key is a 400."""
    options = fields.get("stream_options", dict, default=None)
    if options is None:
        return False
    if not stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    for key, value in options.items():
        where = f"stream_options.{key}"
        if key == "include_usage" and not isinstance(value, bool) and value is not None:
            raise APIError(400, f"{where} must be true or false, got {value!r}", param=where)
        if key == "include_obfuscation" and value not in (False, None):
            raise APIError(400, f"{where}={value!r} is not supported: no obfuscation field is sent "
                                "(send false or leave it out)", param=where, code="unsupported_field")
        if key not in ("include_usage", "include_obfuscation"):
            raise APIError(400, f"unknown field {where!r}: stream_options takes include_usage", param=where,
                           code="unknown_field")
    return options.get("include_usage") is True


def _options(fields: "_Fields", n: int) -> dict[str, Any]:
    """OpenAI and fastdecode fields -> GenerationConfig options (validated again by the engine)."""
    max_tokens = fields.integer("max_completion_tokens", None, low=1)  # the newer name wins
    legacy_max_tokens = fields.integer("max_tokens", None, low=0)  # 0: echo only (extras.py checks)
    if max_tokens is None:
        max_tokens = legacy_max_tokens
    temperature = fields.number("temperature", 1.0, low=0.0, high=2.0)
    options: dict[str, Any] = {
        "max_new_tokens": max_tokens,  # None: the server fills in what the context allows
        "do_sample": temperature > 0,
        "temperature": temperature if temperature > 0 else 1.0,
        "top_p": fields.number("top_p", 1.0, low=0.0, high=1.0, low_open=True),
        "top_k": fields.integer("top_k", None, low=0),
        "min_new_tokens": fields.integer("min_tokens", 0, low=0),
        "repetition_penalty": fields.number("repetition_penalty", 1.0, low=0.0, low_open=True),
        "no_repeat_ngram_size": fields.integer("no_repeat_ngram_size", 0, low=0),
        "num_beams": fields.integer("num_beams", 1, low=1, high=16),
        "length_penalty": fields.number("length_penalty", 1.0),
        "seed": fields.integer("seed", None),
    }
    stop = body_stop(fields)
    if stop:
        options["stop"] = stop
    if options["num_beams"] > 1:
        if options["do_sample"] and "temperature" in fields.body:
            raise APIError(400, "beam search is deterministic: use temperature 0 (or leave it out) with num_beams",
                           param="temperature")
        options["do_sample"] = False
        if n > options["num_beams"]:
            raise APIError(400, f"n ({n}) must be <= num_beams ({options['num_beams']})", param="n")
        options["num_return_sequences"] = n
    if max_tokens is not None and options["min_new_tokens"] > max_tokens:
        raise APIError(400, f"min_tokens ({options['min_new_tokens']}) exceeds max_tokens ({max_tokens})",
                       param="min_tokens")
    return options


def body_stop(fields: "_Fields") -> list[str]:
    stop = fields.body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them",
                       param="stop")
    return stops


def _logprobs(fields: "_Fields", endpoint: str) -> int | None:
    limit = MAX_TOP_LOGPROBS[endpoint]
    if endpoint == "completion":
        return fields.integer("logprobs", None, low=0, high=limit)
    wanted = fields.get("logprobs", bool, default=False)
    top = fields.integer("top_logprobs", None, low=0, high=limit)
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _completion_prompts(fields: "_Fields") -> list[Any]:
    prompt = fields.body.get("prompt")
    bad = APIError(400, "prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
                        "token-id lists", param="prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) and all(is_int(t) for t in p)
                                                     for p in prompt):
        prompts = list(prompt)
    else:
        raise bad
    if any(len(p) == 0 for p in prompts):
        raise bad
    return prompts


def _messages(fields: "_Fields") -> list[dict[str, Any]]:
    """{role, content} messages; also the tool round trip's forms: an assistant message with
    ``tool_calls`` (content null) and a ``tool`` message with ``tool_call_id``."""
    messages = fields.body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    parsed = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"{where} must be an object with a string role", param=where)
        if message["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(400, f"{where}.role must be system, user, assistant or tool, got {message['role']!r}",
                           param=f"{where}.role")
        role = "system" if message["role"] == "developer" else message["role"]
        calls = message.get("tool_calls") if role == "assistant" else None
        content = message.get("content")
        entry: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _content(content, where)}
        if message.get("name") is not None:  # a participant's name, for templates that show it (as vLLM)
            if not isinstance(message["name"], str):
                raise APIError(400, f"{where}.name must be a string", param=f"{where}.name")
            entry["name"] = message["name"]
        if calls:
            entry["tool_calls"] = _tool_calls(calls, where)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}.tool_call_id must be the id of the call this answers",
                               param=f"{where}.tool_call_id")
            entry["tool_call_id"] = call_id
        parsed.append(entry)
    return parsed


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier calls: [{id, type: function, function: {name, arguments}}]."""
    bad = APIError(400, f"{where}.tool_calls must be a list of {{id, type: function, function: {{name, arguments}}}}",
                   param=f"{where}.tool_calls")
    if not isinstance(calls, list):
        raise bad
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", "{}"), (str, dict)):
            raise bad
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "{}")}})
    return out


def _content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of {"type": "text", "text"} parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where}.content must be a string or a list of text parts", param=f"{where}.content")


class _Fields:
    """Typed access to a body's fields: a wrong type or range is an APIError naming the field."""

    def __init__(self, body: dict[str, Any]):
        self.body = body

    def get(self, name: str, kind: type, default: Any) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise APIError(400, f"{name} must be of type {kind.__name__}, got {type(value).__name__}", param=name)
        return value

    def integer(self, name: str, default: int | None, low: int | None = None, high: int | None = None) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not is_int(value) or (low is not None and value < low) or (high is not None and value > high):
            raise APIError(400, f"{name} must be an integer{_range(low, high)}, got {value!r}", param=name)
        return value

    def number(self, name: str, default: float, low: float | None = None, high: float | None = None,
               low_open: bool = False) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and (low is None or (value > low if low_open else value >= low)) and (high is None or value <= high)
        if not ok:
            bound = f" in {'(' if low_open else '['}{low}, {high}]" if high is not None else _range(low, None, low_open)
            raise APIError(400, f"{name} must be a number{bound}, got {value!r}", param=name)
        return float(value)


def _range(low: float | None, high: float | None, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in [{low}, {high}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    return ""
