"""What a batch run is given: how inputs are grouped (``BatchSettings``, a frozen record checked when
it is built) and whether prompts are chat turns (``resolve_chat``). Which model to load is
``load_settings.LoadSettings``, above the API it calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOptionError
from ..validation import positive_int

DEFAULT_BATCH_SIZE = 16
WINDOW_BATCHES = 8  # default look-ahead: this many batches' worth of inputs are sorted together
TOKEN_BUDGET_WINDOW = 256  # default look-ahead when batches are limited by max_batch_tokens
POST_QUEUE = 2  # generated batches waiting for the writer thread


@dataclass(frozen=True)
class BatchSettings:
    """How inputs are grouped; ``batch_size`` and ``max_batch_tokens`` exclude each other."""

    batch_size: int | None = None  # prompts per batch (default DEFAULT_BATCH_SIZE)
    max_batch_tokens: int | None = None  # padded-token budget per batch (see batching.padded_tokens)
    lookahead: int | None = None  # inputs sorted together by length (the reorder bound)
    chat: bool = False  # wrap each plain prompt as a user message with the chat template
    fail_fast: bool = False  # stop at the first failed input instead of recording it

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_batch_tokens", "lookahead"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), name)
        if self.batch_size is not None and self.max_batch_tokens is not None:
            raise InvalidOptionError("give batch_size or max_batch_tokens, not both")

    @property
    def rows(self) -> int | None:
        """Prompts per batch, or None when a token budget limits batches instead."""
        if self.max_batch_tokens is not None:
            return None
        return self.batch_size or DEFAULT_BATCH_SIZE

    @property
    def window(self) -> int:
        if self.lookahead is not None:
            return self.lookahead
        return self.rows * WINDOW_BATCHES if self.rows else TOKEN_BUDGET_WINDOW

    def max_items_in_flight(self) -> int:
        """The most inputs read but not yet written: the memory bound, whatever the input size.

        Three windows: one the reader fills (or holds, blocked on the full queue), one queued,
        one in the caller's hands. Plus earlier windows not yet fully written: the writer takes
        batches first in, first out, so those are the windows of the last POST_QUEUE + 1
        generated batches, which span one earlier window when a window has that many batches
        (its records wait in the reorder buffer for its oldest pending batch), else up to
        POST_QUEUE + 1 of them.
        """
        batches_per_window = self.window // self.rows if self.rows else 1
        earlier = 1 if batches_per_window >= POST_QUEUE + 1 else POST_QUEUE + 1
        return (3 + earlier) * self.window


def resolve_chat(generator: Any, chat: bool | None) -> bool:
    """--chat / --no-chat, or by default: on when the model's tokenizer has a chat template."""
    if chat is not None:
        return chat
    return bool(generator.tokenizer is not None and generator.tokenizer.chat_template)
