"""The contract a model's forward attends through, and the naive view of the reference path.

Every forward takes a cache view: the engine's ``StepPlan`` (engine/plan.py: a step's rows over the
slot cache), a stream's ``StreamPlan`` / ``MixedPlan`` (engine/stream_plan.py), the decode step's
fixed-shape plan, or ``NoCache`` (``use_cache=False``, generation/reference.py). The view, not the
model, writes the forward's K/V (in ``attend``), knows where every key sits (``relative_positions``)
and carries the forward's ``Products`` (its rows' roles and thread budget, layers/products.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..layers.attention import attention
from ..layers.products import Products


class CacheView(Protocol):
    products: Products

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        """Record this forward's k, v [B, Hkv, T, D] for ``layer`` and attend q [B, H, T, D] over every
        key the view holds for it -> [B, H, T, D] (``softcap``: attention logit soft-capping). ``mask``
        (additive [B, 1, T, S]) is the naive view's; the engine's plans mask from their own layout."""
        ...

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Key minus query position [B, T, S] for every key the view holds (ALiBi's bias)."""
        ...


class NoCache:
    """The naive path (``use_cache=False``): attend within the tokens of this forward only, run with
    ``products`` (its rows' roles and thread budget)."""

    def __init__(self, products: Products):
        self.products = products

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        return attention(q, k, v, mask, scale, softcap, threads=self.products.threads)

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        return query_positions[:, None, :] - query_positions[:, :, None]  # the keys are these tokens
