"""Which request fields each endpoint honours: every other field is refused, never silently dropped.

Three kinds of field:
* served: fastdecode implements it (OpenAI's fields and the vLLM / llama.cpp extensions below);
* accepted only with the value that means "nothing special" (``store: false``, ``modalities:
  ["text"]``, ...), or carrying no instruction for the output (``user``, ``metadata``, ...);
* known but not served (audio, reasoning effort, the deprecated functions, ...): always a 400 naming the field.

A field fastdecode does not know at all is a 400 naming it too, unless the server runs with
``--lenient``: then it is logged and ignored (for clients that send vendor extras).
A null value is the same as an absent field (as OpenAI treats it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .protocol import APIError

log = logging.getLogger("fastdecode.serve")

SAMPLING = {"model", "n", "stream", "stream_options", "user", "max_tokens", "temperature", "top_p", "seed", "stop",
            "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "best_of",
            # vLLM / llama.cpp / Hugging Face extensions
            "top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "no_repeat_ngram_size",
            "num_beams", "length_penalty", "use_beam_search", "speculative",
            "prediction"}  # speculative decoding: serve/extras.py
STRUCTURED = {"response_format", "structured_outputs", "json_schema", "grammar"}  # serve/structured.py
SERVED = {
    "completion": SAMPLING | STRUCTURED | {"prompt", "echo", "suffix"},
    "chat": SAMPLING | STRUCTURED | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "parallel_tool_calls"},  # tools: serve/tools.py
}
# Fields that say nothing about the output: identifiers and hints (the prefix cache is automatic).
NO_EFFECT = {"metadata", "safety_identifier", "prompt_cache_key"}
# Fields accepted only with the value that asks for nothing fastdecode lacks.
NEUTRAL_VALUES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (lambda v: v is False, "stored completions are not kept: send store: false or leave it out"),
    "service_tier": (lambda v: v in ("auto", "default"), "there is one service tier: 'auto' or 'default'"),
    "modalities": (lambda v: v == ["text"], "the only output modality is text: ['text']"),
}
# OpenAI fields fastdecode knows and does not serve: a 400 even with --lenient (dropping them would
# change what the client gets).
NOT_SERVED = {
    "audio": "audio output is not available",
    "reasoning_effort": "this server runs no reasoning-effort control",
    "verbosity": "verbosity control is not implemented", "web_search_options": "web search is not available",
    "moderation": "moderation is not available", "prompt_cache_retention": "the prefix cache has no retention "
    "policy to choose", "prompt_cache_options": "the prefix cache has no options to set",
    "functions": "the deprecated functions are not implemented: use tools",
    "function_call": "the deprecated function_call is not implemented: use tool_choice",
}


def check_fields(body: dict[str, Any], endpoint: str, lenient: bool) -> None:
    """Raise APIError (400, ``param`` = the field) for the first field the endpoint cannot honour;
    with ``lenient``, fields fastdecode does not know are logged instead."""
    for name, (accepts, why) in NEUTRAL_VALUES.items():
        if body.get(name) is not None and not accepts(body[name]):
            raise APIError(400, f"{name}={body[name]!r} is not supported: {why}", param=name, code="unsupported_field")

    def hint(name: str) -> str:
        other = [e for e in SERVED if e != endpoint and name in SERVED[e]]
        return f" (it is a field of the {other[0]} endpoint)" if other else ""

    check_known(body, SERVED[endpoint] | NO_EFFECT | set(NEUTRAL_VALUES), NOT_SERVED, lenient, f"{endpoint} API", hint)
    if endpoint == "chat":
        check_message_fields(body.get("messages"), lenient)
        check_tool_fields(body.get("tools"), lenient)


TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}  # strict: "required" / a named call is enforced


def check_tool_fields(tools: Any, lenient: bool) -> None:
    """A 400 naming ``tools[i].key`` / ``tools[i].function.key`` for a non-null key a function tool does not
    take (unless ``lenient``: logged); bad shapes are serve/tools.py's to name."""
    for index, tool in enumerate(tools if isinstance(tools, list) else []):
        function = tool.get("function") if isinstance(tool, dict) else None
        for where, part, keys in ((f"tools[{index}].", tool, TOOL_KEYS),
                                  (f"tools[{index}].function.", function, FUNCTION_KEYS)):
            if isinstance(part, dict):
                check_known(part, keys, {}, lenient, "chat API", lambda name, keys=keys: f" (it takes "
                            f"{', '.join(sorted(keys))})", where=where)


# Keys of a chat message beyond role and content (serve/protocol.py reads them), by the roles that carry them.
MESSAGE_KEYS = {"name": ("system", "developer", "user", "assistant"), "tool_calls": ("assistant",),
                "tool_call_id": ("tool",)}
# OpenAI's assistant-message keys fastdecode cannot take back: accepted only as null.
MESSAGE_NULL_ONLY = {"refusal": "an earlier refusal cannot be shown to the model: put it in the content",
                     "audio": "audio is not available", "function_call": "the deprecated function_call is not "
                     "implemented: use tool_calls"}
# An OpenAI reply's keys that hold nothing for the model when empty (a reply message passed back as it came).
MESSAGE_EMPTY_ONLY = {"annotations": "an earlier reply's citations cannot be shown to the model"}


def check_message_fields(messages: Any, lenient: bool) -> None:
    """A 400 naming ``messages[i].key`` for a non-null key a message of its role cannot carry: another
    role's key, OpenAI's that fastdecode does not take always, unknown ones unless ``lenient`` (then logged
    and ignored)."""
    if not isinstance(messages, list):
        return  # protocol.py names the bad shape
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        where = f"messages[{index}]."
        for key, roles in MESSAGE_KEYS.items():
            if message.get(key) is not None and message.get("role") not in roles:
                raise APIError(400, f"{where}{key}: {key} belongs to {' / '.join(roles)} messages",
                               param=where + key)
        passed_back = {key for key in MESSAGE_EMPTY_ONLY if message.get(key) == []}
        check_known(message, {"role", "content", *MESSAGE_KEYS, *passed_back},
                    {**MESSAGE_NULL_ONLY, **MESSAGE_EMPTY_ONLY}, lenient, "chat API",
                    lambda name: " (a message takes role, content, name, tool_calls (assistant) and tool_call_id "
                                 "(tool))", where=where)


def check_known(body: dict[str, Any], served: set[str], refused: dict[str, str], lenient: bool, api: str,
                hint: Callable[[str], str] = lambda name: "", where: str = "") -> None:
    """A 400 naming the first non-null field that is not ``served``: ``refused`` ones always (with
    why), unknown ones unless ``lenient`` (then logged and ignored). ``where``: the path of ``body``
    in the request (``"messages[0]."``; the request itself: ""), put before each field's name."""
    for name, value in body.items():
        if value is None or name in served:
            continue
        path = where + name
        if name in refused:
            raise APIError(400, f"{path} is not supported: {refused[name]}", param=path, code="unsupported_field")
        if lenient:
            log.warning("ignoring the unknown field %r of a %s request (--lenient)", path, api)
            continue
        raise APIError(400, f"unknown field {path!r}{hint(name)}: fastdecode's {api} does not implement it (start "
                            "the server with --lenient to ignore unknown fields)", param=path, code="unknown_field")
