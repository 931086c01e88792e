"""The capturable decode step: fixed shapes per batch-size bucket, no host sync inside.

For a bucket of B rows (one query each), every tensor the step touches has a shape fixed by
(B, n): the rows' block tables ``[B, n]`` cover every block a row may ever own, and the mask
built from the positions hides the slots not written yet, as gpt-fast's cache update returns the full buffer instead of a slice to the current length. Positions,
slots and the mask are tensors, the K/V writes are ``index_copy_`` at tensor indices, and the
next token is chosen on the device (``argmax``): nothing inside asks the host for a value, so
``torch.compile(fullgraph=True, dynamic=False)`` (or a CUDA graph) captures one graph per bucket.

A layered cache (engine/slots.py) adds one table per sliding kind, ``[B, m]`` with a fixed
``m = (window - 1) // block + 2`` (every block one query can see), starting at each row's first
visible block, and that block's first position ``[B, 1]``: a sliding layer reads only its window,
whatever the context length, still at fixed shapes.
"""

from __future__ import annotations

import torch

from ..layers.attention import attention, paged_attention, paged_attention_runs
from ..layers.products import Products
from ..layers.attention import position_mask
from .slots import SlotCache


class DecodePlan:
    """The cache view of one fixed-shape decode step (the model calls ``attend`` per layer)."""

    def __init__(self, cache: SlotCache, block_table: torch.Tensor, positions: torch.Tensor,
                 windows: list[int | None], score_bias, dtype: torch.dtype, products: Products,
                 window_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()):
        self.cache = cache
        self.products = products  # every row generated; the thread budget
        size = cache.block_size
        # kind -> (tables [B, n]: the blocks a row may read, first key position [B, 1])
        self.tables = {None: (block_table, torch.zeros_like(positions)[:, None])}
        self.tables.update(zip(cache.windows, window_tables))
        self.write_slots, self.distance = {}, {}
        for kind, (table, key_starts) in self.tables.items():
            index = (positions - key_starts[:, 0]) // size  # [B] block of the new token in the row's table
            self.write_slots[kind] = table.gather(1, index[:, None])[:, 0] * size + positions % size  # [B]
            key_positions = key_starts + torch.arange(table.shape[1] * size, device=table.device)  # [B, S]
            self.distance[kind] = (key_positions - positions[:, None])[:, None]  # [B, 1, S]
        self.windows, self.score_bias, self.dtype = windows, score_bias, dtype
        self._masks: dict[tuple[int | None, int | None], torch.Tensor] = {}
        self._bias: dict[int | None, torch.Tensor] = {}  # kind -> position bias [B, 1|H, S] (paged op)
        self.positions = positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """q [B, H, 1, D]; k, v [B, Hkv, 1, D] -> [B, H, 1, D] over each row's slots of the layer's
        kind (masked from the plan's own tables). The C++ paged attention where it is built
        (float32 on the CPU, no ``softcap``), else gather + mask + ``attention``."""
        kind, window = self.cache.layer_windows[layer], self.windows[layer]  # storage kind, mask window
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        table, key_starts = self.tables[kind]
        if softcap is None and paged_attention_runs(q, keys):  # the C++ op: write and attend in place
            if kind not in self._bias and self.score_bias is not None:
                self._bias[kind] = self.score_bias(self.distance[kind])[:, :, 0].float().contiguous()  # [B, 1|H, S]
            write = (k[:, :, 0], v[:, :, 0], self.write_slots[kind])  # [B, Hkv, D] x 2, [B]
            out = paged_attention(q[:, :, 0], keys, values, table, key_starts[:, 0], self.positions,
                                  self.cache.block_size, window, scale, self._bias.get(kind), write,
                                  threads=self.products.threads)  # [B, H, D]
            return out[:, :, None]  # [B, H, 1, D]
        keys.index_copy_(0, self.write_slots[kind], k[:, :, 0])  # [B, Hkv, D]
        values.index_copy_(0, self.write_slots[kind], v[:, :, 0])
        kg = self.cache.gather(keys, table)  # [B, Hkv, S, D]
        vg = self.cache.gather(values, table)  # [B, Hkv, S, D]
        if (kind, window) not in self._masks:
            self._masks[kind, window] = position_mask(self.distance[kind], window, self.score_bias, self.dtype)
        return attention(q, kg, vg, self._masks[kind, window], scale, softcap, threads=self.products.threads)


def decode_step(model, cache: SlotCache, windows: list[int | None], score_bias, products: Products,
                block_table: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                window_tables: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B rows: tokens, positions [B], block tables [B, n] (and each sliding
    kind's (tables [B, m], first key positions [B, 1]), in ``cache.windows`` order) -> (logits
    [B, V], greedy next tokens [B]), both on the device. Bind the first five arguments
    (functools.partial; ``products``: ``decode_products(model)``) and compile the rest: the shapes depend
    only on (B, n)."""
    plan = DecodePlan(cache, block_table, positions, windows, score_bias, model.dtype, products, window_tables)
    logits = model.forward(tokens[:, None], positions[:, None], plan)[:, -1]  # [B, V]
    return logits, logits.argmax(dim=-1)


def decode_products(model) -> Products:
    """A decode step's ``Products``: every row generated, the thread budget of the caller that binds
    the step (inside torch.compile the kernels read torch's count when they run), the model's kernel
    choice."""
    return Products.generated(torch.get_num_threads(), kernels=model.kernels)


def decode_window_tables(cache: SlotCache, tables: list, positions: list[int], device: torch.device | None = None
                         ) -> tuple:
    """Each sliding kind's fixed-shape view for rows decoding at ``positions`` (``decode_step``'s
    ``window_tables``), made on ``device`` (default: the cache's; a CUDA graph's inputs are made on
    the host and copied into its static buffers)."""
    size = cache.block_size
    return tuple(cache.window_tables(tables, positions, [p + 1 for p in positions], w, (w - 1) // size + 2,
                                     device=device)
                 for w in cache.windows)
