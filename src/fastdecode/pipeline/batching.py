"""Forming batches from a look-ahead window of tokenized inputs: length buckets, little padding.

Prompts in a batch are left-padded to the longest one, so a batch of similar lengths wastes
little compute. The reader collects a window of ``lookahead`` inputs, sorts them by prompt
length and cuts the sorted run into batches (by row count, or by a padded-token budget).
Batches of a window are then ordered by their oldest input, so that the start of the window is
written first and the reorder buffer, which must hold every result that finished before the
results ahead of it, never holds more than one window.
"""

from __future__ import annotations

from collections.abc import Sequence

from .inputs import InputItem


def padded_tokens(longest_prompt: int, rows: int, rows_per_prompt: int, max_new_tokens: int) -> int:
    """Cache slots a batch reserves: every row padded to the longest prompt plus the new tokens.

    ``rows_per_prompt`` is num_return_sequences: each prompt is generated that many times.
    """
    return rows * rows_per_prompt * (longest_prompt + max_new_tokens)


def plan_window(items: Sequence[InputItem], batch_size: int | None, max_batch_tokens: int | None,
                rows_per_prompt: int = 1, max_new_tokens: int = 0) -> list[list[InputItem]]:
    """Cut a window of tokenized items into batches of similar prompt length.

    Exactly one of ``batch_size`` (prompts per batch) and ``max_batch_tokens`` (padded-token
    budget, see ``padded_tokens``) limits a batch; an item over the budget on its own still runs,
    alone. Returns the batches ordered by their smallest ``seq``.
    """
    if (batch_size is None) == (max_batch_tokens is None):
        raise ValueError("give exactly one of batch_size and max_batch_tokens")
    ordered = sorted(items, key=lambda item: (len(item.ids), item.seq))
    batches: list[list[InputItem]] = []
    current: list[InputItem] = []
    for item in ordered:
        # Sorted ascending, so the new item is the longest of the batch it would join.
        if batch_size is not None:
            fits = len(current) < batch_size
        else:
            fits = padded_tokens(len(item.ids), len(current) + 1, rows_per_prompt, max_new_tokens) <= max_batch_tokens
        if current and not fits:
            batches.append(current)
            current = []
        current.append(item)
    if current:
        batches.append(current)
    batches.sort(key=lambda batch: min(item.seq for item in batch))
    return batches


def padding_share(batches: Sequence[Sequence[InputItem]]) -> float:
    """Fraction of prompt slots that are padding (0 = every batch has equal lengths); for stats."""
    total = sum(len(batch) * max(len(item.ids) for item in batch) for batch in batches if batch)
    real = sum(len(item.ids) for batch in batches for item in batch)
    return 1.0 - real / total if total else 0.0
