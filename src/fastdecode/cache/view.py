"""The contract a model's forward attends through, and the naive view of the reference path.

Every forward takes a cache view: the engine's ``StepPlan`` (engine/plan.py: a step's rows over the
slot cache), a stream's ``StreamPlan`` / ``MixedPlan`` (engine/stream_plan.py), the decode step's
fixed-shape plan, or ``NoCache`` (``use_cache=False``, generation/reference.py). The view, not the
model, writes the forward's K/V (in ``attend``), masks (causality, padding, a sliding layer's
window, ALiBi's position bias: all from ``layers.attention.position_mask`` and the view's own
layout) and carries the forward's ``Products`` (its rows' roles and thread budget,
layers/products.py). A model has no mask argument and builds no mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..layers.attention import attention, position_mask
from ..layers.products import Products


class CacheView(Protocol):
    products: Products

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """Record this forward's k, v [B, Hkv, T, D] for ``layer`` and attend q [B, H, T, D] over every
        key the view holds for it, under the layer's mask -> [B, H, T, D] (``softcap``: attention
        logit soft-capping)."""
        ...


class NoCache:
    """The naive path (``use_cache=False``): attend within the tokens of this forward only, run with
    ``products``. ``mask``: additive [B, 1, T, T] over the forward's slots (causality and left
    padding; an encoder-decoder's decoder self-bias), None: every key visible. With ``positions``
    [B, T] a layer's ``layer_windows`` entry and ``score_bias`` (ALiBi) add their terms by position."""

    def __init__(self, products: Products, mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                 layer_windows: list[int | None] | None = None, score_bias: Callable | None = None):
        self.products, self.mask, self.positions = products, mask, positions
        self.layer_windows, self.score_bias = layer_windows, score_bias
        self._masks: dict[int | None, torch.Tensor | None] = {}

    @classmethod
    def of_model(cls, model, products: Products, mask: torch.Tensor | None, positions: torch.Tensor) -> "NoCache":
        """The view of a decoder-only model's forward over ``positions``: its layers' windows and its
        position bias (ALiBi) come from the model."""
        cfg = model.config
        return cls(products, mask, positions, cfg.layer_windows,
                   model.alibi_bias if cfg.position_kind == "alibi" else None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        return attention(q, k, v, self._mask(layer, q.dtype), scale, softcap, threads=self.products.threads)

    def _mask(self, layer: int, dtype: torch.dtype) -> torch.Tensor | None:
        window = self.layer_windows[layer] if self.layer_windows else None
        if self.positions is None or (window is None and self.score_bias is None):
            return self.mask
        if window not in self._masks:
            distance = self.positions[:, None, :] - self.positions[:, :, None]  # [B, T, S]: key - query position
            by_position = position_mask(distance, window, self.score_bias, dtype)  # [B, 1 or H, T, S]
            self._masks[window] = by_position if self.mask is None else self.mask + by_position
        return self._masks[window]
