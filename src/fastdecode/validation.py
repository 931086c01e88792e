"""Type checks at the Python API boundary: every public entry point normalizes its inputs here.

Each function takes what a user may pass and returns the one form the engine uses (a str, a
list of chat messages, lists of Python ints), or raises ``InvalidPromptError`` /
``InvalidOptionError`` naming the argument. Token ids may be lists / tuples of ints, or torch
tensors and numpy arrays of an integer dtype (1-D for one sequence, 2-D for many).
"""

from __future__ import annotations

import math
import os
from typing import Any

from .errors import InvalidOptionError, InvalidPromptError


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is an int subclass, never a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def positive_int(value: Any, name: str) -> int:
    """A count or a size option: an int >= 1 (not a bool) -> itself, else InvalidOptionError naming it."""
    if not is_int(value) or value < 1:
        raise InvalidOptionError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _type(value: Any) -> str:
    return type(value).__name__


def check_text(text: Any, what: str = "the prompt") -> str:
    """A str that encodes as UTF-8 (no lone surrogates) -> itself."""
    if isinstance(text, (bytes, bytearray)):
        raise InvalidPromptError(f"{what} must be text (str), got {_type(text)}: decode it first, "
                                 "e.g. data.decode('utf-8')")
    if not isinstance(text, str):
        raise InvalidPromptError(f"{what} must be a string, got {_type(text)}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidPromptError(f"{what} is not valid Unicode: {exc.reason} at character {exc.start} "
                                 f"({text[exc.start:exc.end]!r})") from None
    return text


def is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def check_chat(messages: list[dict], what: str = "the conversation") -> list[dict]:
    for index, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise InvalidPromptError(f'{what}: message {index} must be {{"role": str, "content": str}}')
        if message.get("content") is not None:  # None: e.g. an assistant turn that only calls a tool
            check_text(message["content"], f"{what}: the content of message {index}")
    return messages


def check_prompt(prompt: Any) -> str | list[dict]:
    """One text prompt or one chat conversation."""
    if is_chat(prompt):
        return check_chat(prompt)
    return check_text(prompt)


def text_prompts(prompts: Any) -> tuple[list[str | list[dict]], bool]:
    """generate()'s argument -> (prompts, single): a str or a conversation is one prompt, a list or
    tuple of them is many."""
    if isinstance(prompts, str) or is_chat(prompts):
        return [check_prompt(prompts)], True
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidPromptError("no prompts given")
        return [check_prompt(p) if not isinstance(p, (list, tuple)) or is_chat(p) else _not_text(p, i)
                for i, p in enumerate(prompts)], False
    return [check_text(prompts)], True  # raises with the type


def _not_text(value: Any, index: int) -> Any:
    raise InvalidPromptError(f"prompt {index} must be a string or a chat conversation, got {_type(value)} "
                             "(token ids go to generate_ids)")


def token_ids(ids: Any, what: str = "the token ids") -> list[int]:
    """One sequence: a list / tuple of ints, or a 1-D integer tensor / array -> list of ints."""
    if isinstance(ids, (str, bytes, bytearray)) or ids is None:
        raise InvalidPromptError(f"{what} must be a sequence of integers, got {_type(ids)}")
    if hasattr(ids, "ndim") and hasattr(ids, "tolist"):  # torch.Tensor, numpy.ndarray
        if ids.ndim != 1:
            raise InvalidPromptError(f"{what} must be 1-D, got a {ids.ndim}-D {_type(ids)}")
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise InvalidPromptError(f"{what} must be a list of integers, got {_type(ids)}")
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise InvalidPromptError(f"{what} must be integers, got {_type(bad[0])} {bad[0]!r}")
    return list(ids)


def token_prompts(prompts: Any) -> list[list[int]]:
    """generate_ids()'s argument: many sequences (a list of them, or a 2-D tensor / array)."""
    if hasattr(prompts, "ndim") and hasattr(prompts, "tolist"):
        if prompts.ndim != 2:
            raise InvalidPromptError(f"generate_ids takes a 2-D tensor [prompts, tokens] (or a list of sequences), "
                                     f"got {prompts.ndim}-D")
        return [token_ids(row, f"prompt {i}") for i, row in enumerate(prompts.tolist())]
    if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, (list, tuple)):
        raise InvalidPromptError(f"generate_ids takes a list of token-id sequences, got {_type(prompts)}")
    if prompts and all(is_int(t) for t in prompts):
        raise InvalidPromptError(f"generate_ids takes a list of prompts, each a list of token ids; got a flat list "
                                 f"of ints: wrap one prompt as [[{', '.join(map(str, prompts[:3]))}, ...]]")
    return [token_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]


def score_input(value: Any) -> str | list[int]:
    """score()'s argument: text, or one sequence of token ids."""
    if isinstance(value, str) or isinstance(value, (bytes, bytearray)):
        return check_text(value, "the text to score")
    return token_ids(value, "the tokens to score")


def check_flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be True or False, got {value!r}")
    return value


def model_source(source: Any) -> Any:
    """load()'s source: None (the embedded model), a path string or os.PathLike."""
    if source is not None and not isinstance(source, (str, os.PathLike)):
        raise InvalidOptionError(f"load() takes a path (str or os.PathLike) or None, got {_type(source)}")
    return source
