"""No-repeat-n-gram blocking on the CPU, kept incrementally: each row's n-grams in a dict.

transformers' rule (NoRepeatNGramLogitsProcessor): a row may not produce a token that completes an
n-gram already in its history, i.e. every token that followed an earlier occurrence of the row's last
n-1 tokens is banned. ``processors.ngram_ban_ids`` finds those by comparing all the history's n-grams
with the tail at every step: about ten small tensor operations (~50 us a step for 4 beams of a
sample, 0.8% of a bart-base beam call) plus a [N, L+1] copy of the history per step and a gather per
beam reordering. Here each row keeps a dict prefix (n-1 tokens) -> the tokens that followed it,
updated with one insertion per new token, so a step's bans are one dict lookup per row. A beam
reordering shares unchanged rows and copies a row only when two beams take it.

The host reads each step's tokens (``tolist``), so this is the CPU path; on a GPU the tensor
kernel runs without host syncs (decoding/sampling.py picks).
"""

from __future__ import annotations

import numpy as np
import torch


class NgramTable:
    """Rows' token histories and their n-gram dicts for ``no_repeat_ngram_size`` n >= 1."""

    def __init__(self, rows: list[list[int]], n: int):
        if n < 1:
            raise ValueError(f"n-gram size must be >= 1, got {n}")
        self.n = n
        self.tokens = [list(row) for row in rows]
        self.tables: list[dict[tuple[int, ...], tuple[int, ...]]] = []
        for tokens in self.tokens:
            table: dict[tuple[int, ...], tuple[int, ...]] = {}
            for end in range(n - 1, len(tokens)):
                key = tuple(tokens[end - (n - 1):end])
                table[key] = table.get(key, ()) + (tokens[end],)
            self.tables.append(table)

    def record(self, tokens: list[int]) -> None:
        """Append one token to each row (one n-gram more per row, once the row holds n tokens)."""
        keep = self.n - 1
        for history, table, token in zip(self.tokens, self.tables, tokens):
            if len(history) >= keep:
                key = tuple(history[len(history) - keep:])
                table[key] = table.get(key, ()) + (token,)
            history.append(token)

    def select_rows(self, rows: list[int]) -> None:
        """Row i becomes row ``rows[i]``; a row taken again is copied (the dict's values are tuples, so a
        shallow copy is independent)."""
        taken: set[int] = set()
        tokens, tables = [], []
        for row in rows:
            if row in taken:
                tokens.append(list(self.tokens[row]))
                tables.append(dict(self.tables[row]))
            else:
                tokens.append(self.tokens[row])
                tables.append(self.tables[row])
                taken.add(row)
        self.tokens, self.tables = tokens, tables

    def banned(self) -> list[tuple[int, ...]]:
        """Each row's banned token ids (may repeat an id): those that followed its last n-1 tokens."""
        keep = self.n - 1
        return [table.get(tuple(history[len(history) - keep:]), ()) if len(history) >= keep else ()
                for history, table in zip(self.tokens, self.tables)]

    def ids(self, vocab_size: int) -> torch.Tensor:
        """The bans as ``processors.ngram_ban_ids`` gives them, on the CPU: [N, W] long, ``vocab_size`` where a
        position bans nothing (W at least 1). Through numpy: torch.tensor of a nested list took ~25 us a
        call inside a beam search, numpy's array ~2."""
        banned = self.banned()
        width = max(1, max((len(ids) for ids in banned), default=0))
        padded = [ids + (vocab_size,) * (width - len(ids)) for ids in banned]  # [N][W]
        return torch.from_numpy(np.array(padded, dtype=np.int64).reshape(len(banned), width))  # [N, W]
