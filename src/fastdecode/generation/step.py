"""The two step primitives and the engines built on them.

``CachedEngine``: prefill once (all prompt tokens in one forward, K/V written into the
preallocated cache), then ``decode`` one token per row per step, attending to the cache: O(n)
work per step. ``RecomputeEngine`` is the seed's vanilla recipe (``use_cache=False``): every step
re-runs the model over the whole sequence, O(n^2) per step. It is kept as the reference the
cached path must equal, and as the baseline that shows the difference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..cache.static import KVCache, NoCache
from ..layers.attention import build_attention_mask
from ..layers.products import Products


class Started(NamedTuple):
    """What starting a generation returns: the engine after its prefill, and where decoding resumes."""

    engine: object  # CachedEngine, RecomputeEngine, a beam engine (generation/beam.py, generation/encdec.py)
    logits: torch.Tensor  # [B, V] for the first new token
    next_positions: torch.Tensor  # [B] position of the token fed at the next decode
    history: list[list[int]]  # tokens the processors count as already seen (repetition penalty)


class CachedEngine:
    def __init__(self, model, batch_size: int, capacity: int):
        cfg = model.config
        self.model = model
        self.cache = KVCache(cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim,
                             model.dtype, model.device)

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor,
                all_logits: bool = False) -> torch.Tensor:
        """tokens, valid, positions [B, T] (left-padded) -> logits of the last slot [B, V]
        (``all_logits``: of every slot, [B, T, V]). May be called again to extend (chunked prefill)."""
        cache = self.cache
        products = Products.prompt(torch.get_num_threads(), kernels=self.model.kernels)
        start = cache.append_slots(valid, positions, products)
        cache.has_padding = cache.has_padding or not bool(valid.all())
        logits = self.model.forward(tokens, positions, cache, self._mask(start, tokens.shape[1]), all_logits)
        return logits if all_logits else logits[:, -1]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B] -> logits [B, V] for the next token of every row."""
        cache = self.cache
        tokens, positions = tokens[:, None], positions[:, None]  # [B, 1]
        start = cache.append_slots(torch.ones_like(tokens, dtype=torch.bool), positions,
                                   Products.generated(torch.get_num_threads(), kernels=self.model.kernels))
        return self.model.forward(tokens, positions, cache, self._mask(start, 1))[:, -1]

    def _mask(self, start: int, num_queries: int) -> torch.Tensor | None:
        cache = self.cache
        end = cache.length
        if num_queries == 1 and not cache.has_padding:
            return None  # one query per row that sees every slot (a sliding layer adds its window itself)
        return build_attention_mask(cache.valid[:, :end], start, num_queries, self.model.dtype)

    def drop_rows(self, rows: torch.Tensor) -> None:
        """Only ``rows`` (an increasing 1-D index) go on: finished rows leave the batch."""
        self.cache.select_rows(rows)


class RecomputeEngine:
    """No cache: the whole (left-padded) sequence is run again at every step."""

    def __init__(self, model):
        self.model = model
        self.tokens = self.valid = self.positions = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens, self.valid, self.positions = tokens, valid, positions
        self.prompt_columns = tokens.shape[1]
        return self._run()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.tokens = torch.cat([self.tokens, tokens[:, None]], dim=1)  # [B, T+1]
        self.valid = torch.cat([self.valid, torch.ones_like(tokens[:, None], dtype=torch.bool)], dim=1)
        self.positions = torch.cat([self.positions, positions[:, None]], dim=1)
        return self._run()

    def _run(self) -> torch.Tensor:
        B, T = self.tokens.shape
        mask = build_attention_mask(self.valid, 0, T, self.model.dtype)
        roles = [column < self.prompt_columns for _ in range(B) for column in range(T)]  # [B * T], row-major
        # each row computed as the cached path computes it
        products = Products.of_rows(roles, torch.get_num_threads(), self.tokens.device, kernels=self.model.kernels)
        return self.model.forward(self.tokens, self.positions, NoCache(products), mask)[:, -1]

    def drop_rows(self, rows: torch.Tensor) -> None:
        self.tokens = self.tokens.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)
