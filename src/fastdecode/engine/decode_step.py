"""The capturable decode step: fixed shapes per batch-size bucket, no host sync inside.

For a bucket of B rows (one query each), every tensor the step touches has a shape fixed by
(B, n): the rows' block tables ``[B, n]`` cover every block a row may ever own, and the mask
built from the positions hides the slots not written yet, as gpt-fast's ``KVCache.update`` returns the full buffer instead of a slice to the current length. Positions,
slots and the mask are tensors, the K/V writes are ``index_copy_`` at tensor indices, and the
next token is chosen on the device (``argmax``): nothing inside asks the host for a value, so
``torch.compile(fullgraph=True, dynamic=False)`` (or a CUDA graph) captures one graph per bucket.
"""

from __future__ import annotations

import torch

from ..layers.attention import attention
from .plan import no_distances, position_mask
from .slots import SlotCache


class DecodePlan:
    """The cache view of one fixed-shape decode step (the model calls ``attend`` per layer)."""

    def __init__(self, cache: SlotCache, block_table: torch.Tensor, positions: torch.Tensor,
                 windows: list[int | None], score_bias, dtype: torch.dtype):
        self.cache = cache
        self.block_table = block_table  # [B, n]: every block a row may own
        size = cache.block_size
        block_of_token = block_table.gather(1, (positions // size)[:, None])[:, 0]  # [B]
        self.write_slots = block_of_token * size + positions % size  # [B] slot of each new token
        key_positions = torch.arange(block_table.shape[1] * size, device=block_table.device)
        self.distance = (key_positions[None, :] - positions[:, None])[:, None]  # [B, 1, S]
        self.windows, self.score_bias, self.dtype = windows, score_bias, dtype
        self._masks: dict[int | None, torch.Tensor] = {}

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        return no_distances(query_positions)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """q [B, H, 1, D]; k, v [B, Hkv, 1, D] -> [B, H, 1, D] over each row's full slot range (``mask``
        unused: the plan builds its own)."""
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        keys.index_copy_(0, self.write_slots, k[:, :, 0])  # [B, Hkv, D]
        values.index_copy_(0, self.write_slots, v[:, :, 0])
        kg = self.cache.gather(keys, self.block_table)  # [B, Hkv, S, D]
        vg = self.cache.gather(values, self.block_table)  # [B, Hkv, S, D]
        window = self.windows[layer]
        if window not in self._masks:
            self._masks[window] = position_mask(self.distance, window, self.score_bias, self.dtype)
        return attention(q, kg, vg, self._masks[window], scale)


def decode_step(model, cache: SlotCache, windows: list[int | None], score_bias, block_table: torch.Tensor,
                tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B rows: tokens, positions [B], block tables [B, n] -> (logits [B, V],
    greedy next tokens [B]), both on the device. Bind the first four arguments (functools.partial)
    and compile the rest: the shapes depend only on (B, n)."""
    plan = DecodePlan(cache, block_table, positions, windows, score_bias, model.dtype)
    logits = model.forward(tokens[:, None], positions[:, None], plan, None)[:, -1]  # [B, V]
    return logits, logits.argmax(dim=-1)
