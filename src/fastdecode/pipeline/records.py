"""Output records (one JSON object per input) and the reorder buffer that keeps input order.

A record is ``{"id", "line", "prompt", "output", "num_tokens", "finish_reason"}``; with
num_return_sequences = r > 1, ``output``, ``num_tokens`` and ``finish_reason`` are lists of r
items. A failed input gives ``{"id" (when known), "line", "error"}``. Every record carries
``line`` (the input's 1-based line number): it is what a resumed run checks its input against.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .inputs import InputItem


def success_record(item: InputItem, texts: Sequence[str], token_counts: Sequence[int],
                   finish_reasons: Sequence[str | None]) -> dict[str, Any]:
    """The record of an input that generated; r > 1 sequences give lists, r = 1 plain values."""
    def one_or_list(values: Sequence[Any]) -> Any:
        return values[0] if len(values) == 1 else list(values)

    return {
        "id": item.id,
        "line": item.line,
        "prompt": item.prompt,
        "output": one_or_list(texts),
        "num_tokens": one_or_list(token_counts),
        "finish_reason": one_or_list(finish_reasons),
    }


def error_record(item: InputItem) -> dict[str, Any]:
    """The record of an input that failed: no output, the reason instead; id only when known."""
    record: dict[str, Any] = {} if item.id is None else {"id": item.id}
    record["line"] = item.line
    record["error"] = item.error
    return record


def is_error(record: dict[str, Any]) -> bool:
    return "error" in record


class ReorderBuffer:
    """Holds results that finished out of order until every earlier one has finished.

    ``push(seq, value)`` returns the values that are now ready, in ``seq`` order. Its size is
    bounded by how far generation runs out of order: the run's ``lookahead`` window (feeding.py).
    """

    def __init__(self, start: int = 0):
        self.next_seq = start
        self.pending: dict[int, Any] = {}
        self.peak = 0

    def push(self, seq: int, value: Any) -> list[Any]:
        if seq < self.next_seq or seq in self.pending:
            raise ValueError(f"result {seq} was already delivered")
        self.pending[seq] = value
        self.peak = max(self.peak, len(self.pending))
        ready = []
        while self.next_seq in self.pending:
            ready.append(self.pending.pop(self.next_seq))
            self.next_seq += 1
        return ready

    def __len__(self) -> int:
        return len(self.pending)
