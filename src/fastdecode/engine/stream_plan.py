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
over all rows; attention runs per part. The streams that decode one generated token in one frame
(most steps of a conversation past its context) attend together in one paged op over their own
blocks, each row masked exactly as its ``StreamPlan`` masks it (the stale keys before its sinks by
a -inf bias); a stream runs that way alone too, so its result never depends on the others. A
one-token prompt chunk attends as its prompt's longer chunks do (never in the paged op).
"""

from __future__ import annotations

import itertools

import torch

from ..layers.attention import (attention, paged_attention, paged_attention_runs, position_mask,
                                 two_segment_attention)
from ..layers.products import Products


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
    def one_query(self) -> bool:
        """One token in one frame (nothing dropped inside, sinks where they sit): a paged decode row."""
        return self.positions.shape[0] == 1 and self.lowest is None and self.corrections is None

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
        self.starts = list(itertools.accumulate(self.sizes[:-1], initial=row_tokens))  # each stream's first flat token
        # the streams decoding one token in one frame attend in one paged op; a one-token prompt chunk
        # attends as its prompt's other chunks do: a prompt's bits never depend on where its chunks end
        self.paged = [i for i, plan in enumerate(streams)
                      if plan.one_query and not products.is_prompt_row(self.starts[i])]
        self.paged_tokens = torch.tensor([self.starts[i] for i in self.paged], device=streams[0].positions.device)
        self._paged_rows: dict[int | None, tuple] = {}
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
        paged = self.paged and softcap is None and paged_attention_runs(q, self.cache.layer_keys[layer])
        together = self._attend_paged(layer, q, scale) if paged else {}
        for index, (plan, start, count) in enumerate(zip(self.streams, self.starts, self.sizes)):
            if index in together:
                outputs.append(together[index])
            else:
                outputs.append(plan.attend_written(layer, q[:, :, start : start + count], scale, softcap))
        return torch.cat(outputs, dim=2)  # [1, H, N, D]

    def _attend_paged(self, layer: int, q: torch.Tensor, scale: float) -> dict[int, torch.Tensor]:
        """The one-query streams (``paged``; their K/V written) in one paged op -> stream index -> [1, H, 1, D]."""
        kind, window = self.cache.layer_windows[layer], self.streams[0].stream.windows[layer]
        table, key_start, positions, bias = self._paged_operands(kind)
        out = paged_attention(q[0].index_select(1, self.paged_tokens).transpose(0, 1), self.cache.layer_keys[layer],
                              self.cache.layer_values[layer], table, key_start, positions, self.cache.block_size,
                              window, scale, bias, threads=self.products.threads)  # [P, H, D]
        return {index: out[row][None, :, None] for row, index in enumerate(self.paged)}  # [1, H, 1, D] each

    def _paged_operands(self, kind: int | None) -> tuple:
        """(table [P, n], first key position [P], query position [P], bias [P, 1 or H, n * block]) of the
        one-query streams in a kind: each row's gathered blocks from its sinks' block on, the keys before
        its sinks hidden by -inf, its position bias (ALiBi) added, as ``StreamPlan._mask`` builds it."""
        if kind not in self._paged_rows:
            size, plans = self.cache.block_size, [self.streams[i] for i in self.paged]
            tables = [plan.kinds[kind][1][0].tolist() for plan in plans]
            width = max(len(t) for t in tables)
            device = plans[0].positions.device
            table = torch.tensor([t + t[-1:] * (width - len(t)) for t in tables], device=device)  # [P, n]
            first = torch.tensor([plan.key_start - plan.offset for plan in plans], device=device)  # [P]
            positions = torch.cat([plan.positions for plan in plans])  # [P]
            keys = first[:, None] + torch.arange(width * size, device=device)[None]  # [P, S] key positions
            distance = keys - positions[:, None]  # [P, S]
            bias = torch.zeros(distance.shape, dtype=torch.float32, device=device)[:, None]  # [P, 1, S]
            score_bias = plans[0].score_bias
            if score_bias is not None:
                bias = score_bias(distance[:, None]).float()[:, :, 0]  # [P, 1|H, S]
            stale = torch.arange(width * size, device=device)[None] < torch.tensor([p.offset for p in plans],
                                                                                  device=device)[:, None]  # [P, S]
            bias = bias.masked_fill(stale[:, None], float("-inf")).contiguous()
            self._paged_rows[kind] = (table, first, positions, bias)
        return self._paged_rows[kind]
