"""``Products``: how one forward runs its products, handed to every ``linear`` call explicitly.

Two things decide a product's arithmetic and speed besides its operands, and both travel here, in
the step plan a model receives (engine/plan.py), never in hidden state:

- **row roles**: which rows of the forward's flattened [R, C] rows are prompt rows (prompt chunks,
  encoder sources, scoring: exact float32 products) and which are generated rows (decode steps,
  beams: the int8 / fixed-order kernels). Layers/quantized.py and layers/linear.py say why;
- **the thread budget**: the thread count of whoever runs the forward. The forward's own small ops
  run on one thread (layers/threads.py); big products and attention get this many.

``linear`` and the attention ops take it as a required argument, so a call site that forgets
cannot silently get other numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALL_PROMPT = "all prompt rows"


class RowRoles:
    """Which rows of one forward's products (its flattened [R, C] rows) are prompt rows."""

    __slots__ = ("rows", "prompt", "generated")

    def __init__(self, is_prompt: list[bool], device: torch.device | str = "cpu"):
        self.rows = len(is_prompt)
        self.prompt = torch.tensor([i for i, p in enumerate(is_prompt) if p], dtype=torch.long, device=device)
        self.generated = torch.tensor([i for i, p in enumerate(is_prompt) if not p], dtype=torch.long, device=device)


@dataclass(frozen=True, slots=True, eq=False)
class Products:
    """``roles``: None (every row generated), ``ALL_PROMPT``, or a ``RowRoles`` (a step mixing both);
    ``threads``: the forward's thread budget (0 inside torch.compile: the op reads torch's count)."""

    roles: RowRoles | str | None
    threads: int

    @classmethod
    def generated(cls, threads: int) -> Products:
        """Every row generated (decode steps, beams)."""
        return cls(None, threads)

    @classmethod
    def prompt(cls, threads: int) -> Products:
        """Every row a prompt row (a prompt, an encoder source, a scored text)."""
        return cls(ALL_PROMPT, threads)

    @classmethod
    def of_rows(cls, is_prompt: bool | list[bool], threads: int, device: torch.device | str = "cpu") -> Products:
        """``is_prompt``: one bool for every row, or one per flattened row (a step mixing both)."""
        if not isinstance(is_prompt, bool) and (all(is_prompt) or not any(is_prompt)):
            is_prompt = all(is_prompt)  # one role for the whole forward
        if isinstance(is_prompt, bool):
            return cls(ALL_PROMPT if is_prompt else None, threads)
        return cls(RowRoles(is_prompt, device), threads)

    @property
    def all_prompt(self) -> bool:
        return self.roles is ALL_PROMPT
