"""What a batch run is given: how many inputs are in flight (``BatchSettings``, a frozen record
checked when it is built) and whether prompts are chat turns (``resolve_chat``). Which model to load
is ``load_settings.LoadSettings``, above the API it calls."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOptionError
from ..validation import positive_int

DEFAULT_BATCH_SIZE = 16
WINDOW_BATCHES = 8  # default lookahead: this many times batch_size
TOKEN_BUDGET_WINDOW = 256  # default lookahead when max_batch_tokens bounds what is in flight
POST_QUEUE = 2  # steps' worth of finished inputs waiting for the writer thread


@dataclass(frozen=True)
class BatchSettings:
    """How many inputs generate at once; ``batch_size`` and ``max_batch_tokens`` exclude each other.

    Nothing is padded or sorted: the engine batches whatever is in flight, continuously
    (pipeline/feeding.py), and these only bound what is in flight."""

    batch_size: int | None = None  # inputs generating at once (default DEFAULT_BATCH_SIZE)
    max_batch_tokens: int | None = None  # or: their cache tokens, sum of rows x (prompt + max_new_tokens)
    lookahead: int | None = None  # an input starts only within this many inputs of the oldest unwritten one
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
        """Inputs generating at once, or None when a token budget bounds them instead."""
        if self.max_batch_tokens is not None:
            return None
        return self.batch_size or DEFAULT_BATCH_SIZE

    @property
    def window(self) -> int:
        """The reorder bound: inputs started but not yet written (also the reader's read-ahead)."""
        if self.lookahead is not None:
            return self.lookahead
        return self.rows * WINDOW_BATCHES if self.rows else TOKEN_BUDGET_WINDOW

    def max_items_in_flight(self) -> int:
        """The most inputs read but not yet written: the memory bound, whatever the input size.

        One ``window`` of inputs started and not yet written (generating, waiting for the
        writer, or in the reorder buffer), one ``window`` read ahead in the inputs queue, one
        input the generation stage holds and one in the reader's hands.
        """
        return 2 * self.window + 2


def resolve_chat(generator: Any, chat: bool | None) -> bool:
    """--chat / --no-chat, or by default: on when the model's tokenizer has a chat template."""
    if chat is not None:
        return chat
    return bool(generator.tokenizer is not None and generator.tokenizer.chat_template)
