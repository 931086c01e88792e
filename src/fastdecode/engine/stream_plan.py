"""The cache views of streams (engine/streaming_policy.py), alone or beside a step's other rows.

``StreamPlan``: one forward's tokens of one stream. Keys are read from the sinks' first position
on (``[sink_start, end + T)``), in every attention kind of the cache (the stream holds blocks of
all its positions in each). Each query of a chunk sees the sinks plus its own last window,
exactly as token by token: window keys it no longer holds are masked (they stay in their slots
until a later forward overwrites them), and when drops happen inside the chunk, query t's sinks
sit ``c_t`` positions too far (the sinks were placed for the chunk's first query): for RoPE the
query is rotated back by ``c_t`` for the sink segment (scores depend only on position
differences) under one softmax with the window segment (``two_segment_attention``); for ALiBi
and window masks the sink distances are corrected by ``c_t``.

``MixedPlan``: one engine forward whose flat tokens are the ordinary rows (a ``StepPlan``)
followed by one segment per stream (its ``StreamPlan``): every product of the step runs once
over all rows; attention runs per part, each as it runs alone.
"""

from __future__ import annotations

import torch

from ..layers.attention import attention, two_segment_attention
from ..layers.products import Products
from ..layers.attention import position_mask


class StreamPlan:
    """``lowest`` [T]: each query's first visible window position (None: all held keys visible);
    ``corrections`` [T]: how many positions query t sees its sinks closer than they sit (None: 0)."""

    def __init__(self, stream, positions: torch.Tensor, lowest: list[int] | None, corrections: list[int] | None):
        self.stream, self.cache, self.positions = stream, stream.cache, positions
        cache, table = self.cache, stream.table
        device = positions.device
        self.key_start = stream.sink_start
        end = stream.end + positions.shape[0]
        size = cache.block_size
        first_block, num_blocks = self.key_start // size, cache.pool.blocks_for(end)
        self.offset = self.key_start - first_block * size  # first key inside the gathered blocks
        self.num_keys = end - self.key_start
        # Per kind: (slot range when the blocks are in order, so the layer buffers are read as
        # views, block table [1, n], write slots [T]).
        self.kinds = {}
        for kind in [None, *cache.windows]:
            blocks = (table if kind is None else table.windows[kind])[first_block:num_blocks]
            contiguous = blocks == list(range(blocks[0], blocks[0] + len(blocks)))
            slot_range = (blocks[0] * size + self.offset, blocks[0] * size + self.offset + self.num_keys) \
                if contiguous else None
            self.kinds[kind] = (slot_range, torch.tensor([blocks], dtype=torch.long, device=device),
                                torch.tensor(cache.slot_ids(table, stream.end, end, kind), device=device))
        self.sinks = stream.sinks
        self.lowest = None if lowest is None else torch.tensor(lowest, device=device)
        self.corrections = None if corrections is None else torch.tensor(corrections, device=device)
        self.split = (stream.ropes is not None and self.sinks > 0 and corrections is not None
                      and any(corrections))  # RoPE with per-query sink frames: two segments
        self.score_bias, self.dtype = stream.score_bias, stream.model.dtype
        self._masks: dict[int | None, torch.Tensor | None] = {}
        self.products: Products | None = None  # the forward's row roles and threads: ``with_products``

    def with_products(self, products: Products) -> "StreamPlan":
        """This plan, run with ``products`` (set by whoever runs its forward; unset, attending fails)."""
        self.products = products
        return self

    @property
    def slot_range(self) -> tuple[int, int] | None:
        """The full kind's keys as one range of slots (None: they are gathered block by block)."""
        return self.kinds[None][0]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """q [1, H, T, D]; k, v [1, Hkv, T, D] -> [1, H, T, D] (masked from the plan's own layout)."""
        write_slots = self.kinds[self.cache.layer_windows[layer]][2]
        self.cache.layer_keys[layer].index_copy_(0, write_slots, k[0].transpose(0, 1))  # [T, Hkv, D]
        self.cache.layer_values[layer].index_copy_(0, write_slots, v[0].transpose(0, 1))
        return self.attend_written(layer, q, scale, softcap)

    def attend_written(self, layer: int, q: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
        """``attend`` once this forward's K/V of the layer are in their slots."""
        slot_range, block_table, _ = self.kinds[self.cache.layer_windows[layer]]
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        kg, vg = self._read(keys, slot_range, block_table), self._read(values, slot_range, block_table)  # [1, Hkv, S, D]
        mask = self._mask(self.stream.windows[layer])
        if not self.split:
            return attention(q, kg, vg, mask, scale, softcap, threads=self.products.threads)
        n = self.sinks
        q_sinks = self.stream.ropes[layer].rotate_by(q, self.corrections.neg())  # sinks seen c_t closer
        return two_segment_attention(q_sinks, kg[:, :, :n], vg[:, :, :n], q, kg[:, :, n:], vg[:, :, n:], mask, scale,
                                     softcap)

    def _read(self, buffer: torch.Tensor, slot_range: tuple[int, int] | None,
              block_table: torch.Tensor) -> torch.Tensor:
        """A layer's K or V [slots, Hkv, D] -> the stream's keys [1, Hkv, S, D]."""
        if slot_range is not None:
            return buffer[slot_range[0] : slot_range[1]].transpose(0, 1)[None]  # [S, Hkv, D] -> [1, Hkv, S, D]
        gathered = self.cache.gather(buffer, block_table)  # [1, Hkv, n * block, D]
        return gathered[:, :, self.offset : self.offset + self.num_keys]

    def _mask(self, window: int | None) -> torch.Tensor | None:
        """Additive [1, 1 or H, T, S] (None: every key visible and no position bias)."""
        if window not in self._masks:
            device = self.positions.device
            keys = self.key_start + torch.arange(self.num_keys, device=device)  # [S]
            distance = keys[None, :] - self.positions[:, None]  # [T, S]
            is_sink = keys < self.key_start + self.sinks  # [S]
            if self.corrections is not None:
                distance = distance + is_sink[None, :] * self.corrections[:, None]  # sinks in each query's frame
            if self.lowest is None and window is None and self.score_bias is None and self.positions.shape[0] == 1:
                self._masks[window] = None
            else:
                mask = position_mask(distance[None], window, self.score_bias, self.dtype)  # [1, 1 or H, T, S]
                if self.lowest is not None:
                    hidden = ~is_sink[None, :] & (keys[None, :] < self.lowest[:, None])  # dropped window keys
                    mask = mask.masked_fill(hidden[None, None], float("-inf"))
                self._masks[window] = mask
        return self._masks[window]


class MixedPlan:
    """``rows`` (a StepPlan over the first ``row_tokens`` flat tokens, or None) then ``streams``
    (StreamPlans, each over its own tokens, in order)."""

    def __init__(self, rows, row_tokens: int, streams: list[StreamPlan], products: Products):
        self.rows, self.row_tokens, self.streams = rows, row_tokens, streams
        self.products = products  # every flat token's role, the step's thread budget
        for plan in streams:
            plan.with_products(products)
        self.sizes = [plan.positions.shape[0] for plan in streams]
        cache = streams[0].cache
        # Every stream's write slots per kind, in flat order: one write per layer for all of them.
        self.write_slots = {kind: torch.cat([plan.kinds[kind][2] for plan in streams])
                            for kind in [None, *cache.windows]}
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               softcap: float | None = None) -> torch.Tensor:
        """q [1, H, N, D]; k, v [1, Hkv, N, D] -> [1, H, N, D]: each part attends over its tokens."""
        first, outputs = self.row_tokens, []
        if self.rows is not None:
            outputs.append(self.rows.attend(layer, q[:, :, :first], k[:, :, :first], v[:, :, :first], scale,
                                            softcap))
        slots = self.write_slots[self.cache.layer_windows[layer]]
        self.cache.layer_keys[layer].index_copy_(0, slots, k[0, :, first:].transpose(0, 1))  # [N', Hkv, D]
        self.cache.layer_values[layer].index_copy_(0, slots, v[0, :, first:].transpose(0, 1))
        for plan, count in zip(self.streams, self.sizes):
            outputs.append(plan.attend_written(layer, q[:, :, first : first + count], scale, softcap))
            first += count
        return torch.cat(outputs, dim=2)  # [1, H, N, D]
