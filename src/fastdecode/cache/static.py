"""The preallocated self-attention KV cache.

One buffer per layer for K and for V, ``[B, Hkv, S, D]``: only the KV heads the model has
(grouped- and multi-query attention keep fewer heads in memory). Slots are written in place
at explicit indices; nothing grows by concatenation. Prompts of different lengths are
left-padded, so every row writes its next token into the same slot; ``valid`` marks the
padding slots and ``positions`` records each slot's token position.

Each forward's ``Products`` (its rows' roles and thread budget, layers/products.py) come with the
slots it reserves (``append_slots``); ``NoCache`` is given them when made, one per forward.
"""

from __future__ import annotations

import torch

from ..layers.attention import attention
from ..layers.products import Products


class KVCache:
    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, Hkv, S, D]
        self._unbind()
        self.valid = torch.zeros(batch_size, capacity, dtype=torch.bool, device=device)  # [B, S]
        self.positions = torch.zeros(batch_size, capacity, dtype=torch.long, device=device)  # [B, S]
        self.length = 0  # slots in use (the same for every row)
        self.write_start = 0  # first slot of the tokens of the current forward
        self.has_padding = False
        self.products: Products | None = None  # the current forward's (``append_slots``)

    def _unbind(self) -> None:
        # Per-layer views, so the hot path indexes a Python list instead of a tensor.
        self.layer_keys = list(self.keys.unbind(0))
        self.layer_values = list(self.values.unbind(0))

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def append_slots(self, valid: torch.Tensor, positions: torch.Tensor, products: Products) -> int:
        """Reserve the next T slots for tokens with these valid flags and positions [B, T], run with
        ``products`` (the forward's row roles and thread budget, which the model reads here).

        Returns the first slot index; layers then ``write`` their K/V there.
        """
        start, T = self.length, valid.shape[1]
        if start + T > self.capacity:
            raise RuntimeError(f"KV cache overflow: {start} + {T} > {self.capacity} slots")
        self.valid[:, start : start + T] = valid
        self.positions[:, start : start + T] = positions
        self.length = start + T
        self.write_start = start
        self.products = products
        return start

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        """Write this forward's k, v [B, Hkv, T, D] into the layer's slots, then attend over every
        filled slot (``softcap``: attention logit soft-capping or None). q [B, H, T, D] -> [B, H, T, D]."""
        keys, values = self.update(layer, self.write_start, k, v)
        return attention(q, keys, values, mask, scale, softcap, threads=self.products.threads)

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, Hkv, T, D] at slot ``start``; return the layer's K, V up to their end."""
        end = start + k.shape[2]
        keys, values = self.layer_keys[layer], self.layer_values[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Key minus query position [B, T, S] for every filled slot (ALiBi builds its bias from these)."""
        return self.positions[:, None, : self.length] - query_positions[:, :, None]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i becomes row ``rows[i]`` in new buffers of ``len(rows)`` rows: finished sequences
        dropped, so they stop costing work."""
        self.keys = self.keys.index_select(1, rows)
        self.values = self.values.index_select(1, rows)
        self._unbind()
        self.valid = self.valid.index_select(0, rows)
        self.positions = self.positions.index_select(0, rows)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


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
