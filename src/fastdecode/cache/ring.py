"""The streaming ("infinite") cache: attention sinks plus a ring-buffer window, batch 1.

Slots [0, n_keep) hold the first tokens of the stream (the attention sinks, StreamingLLM); the
other slots are a ring. The *policy* is defined token by token: the cache holds the sinks and at
most ``window = n_ctx - n_keep`` window tokens; when a token arrives to a full window, the
``n_discard`` oldest window tokens are dropped and the rest move ``n_discard`` positions closer.
Nothing is ever moved or copied; each slot remembers the absolute stream position of its token.

Position shifting without recomputation. After ``shift`` tokens have been dropped, the kept
window tokens must look ``shift`` positions closer to the sinks. Every key is stored rotated
(RoPE) at its absolute position a. RoPE scores depend only on the difference of the two
positions, so for window keys the shift cancels: (a_q - shift) - (a - shift) = a_q - a, and the
query rotated at its absolute position a_q is right as it is. Only the ``n_keep`` sink keys (which
keep positions 0..n_keep-1) sit in another frame: the query must see them ``shift`` positions
closer. When every query of a forward has the same shift (always so when generating), the cache
rotates its few sink keys from their stored originals by +shift, once per forward for all layers,
and attention is one ordinary call; no window key is ever rewritten, so a one-in, one-out ring
costs O(n_keep) extra per step. When the queries of a chunk have different shifts, each query is
rotated back by its own shift for the sink segment instead, under one softmax over both
segments. For ALiBi the same frames give the key-query distances the bias is built from.

Chunks. The ring may have ``headroom`` slots beyond the window, so that a chunk of up to
``headroom + 1`` tokens can be written at once: each query then gets its own visible range and its
own shift (what the cache would have held had the tokens come one at a time), so chunked
processing equals token-by-token processing for any ``n_discard`` (fast scoring of long texts).
Without headroom a chunk can still run up to the point where the policy next drops tokens.
"""

from __future__ import annotations

import torch

from ..layers.attention import attention, two_segment_attention
from ..layers.positions import RotaryEmbedding


class StreamingCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        n_ctx: int,
        n_keep: int,
        n_discard: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layer_ropes: list[RotaryEmbedding] | None = None,
        headroom: int = 0,
    ):
        self.n_ctx, self.n_keep, self.n_discard = n_ctx, n_keep, n_discard
        self.window = n_ctx - n_keep
        self.ring_size = self.window + headroom
        capacity = n_keep + self.ring_size
        shape = (num_layers, 1, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, Hkv, slots, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, Hkv, slots, D]
        self.layer_keys = list(self.keys.unbind(0))
        self.layer_values = list(self.values.unbind(0))
        # RoPE: sinks are re-rotated into the window's frame, each layer by its own rotary table (layers
        # of different attention kinds may have different bases); None (ALiBi): no rotation.
        self.layer_ropes = layer_ropes
        self.rope_groups = _layers_by_rope(layer_ropes) if layer_ropes is not None else []
        # Sink keys as stored (rotated at their own positions); the cache's sink slots hold them
        # rotated into the frame of shift ``sink_frame``.
        self.sink_keys = torch.zeros(shape[:3] + (n_keep, head_dim), dtype=dtype, device=device)
        self.sink_frame = 0
        self.device = torch.device(device)
        self.slot_positions = torch.full((capacity,), -1, dtype=torch.long, device=device)  # -1 = empty
        # Physical state: which slots hold which tokens.
        self.sinks = 0
        self.ring_head = 0  # oldest stored window token, as an offset into the ring
        self.ring_count = 0  # window tokens stored (visible or not)
        self.used = 0  # slots [0, used) have been written at least once
        # Logical state (the policy, token by token).
        self.window_count = 0  # window tokens the policy holds
        self.shift = 0  # tokens the policy has dropped
        # Per forward: slots written, and each query's first visible window position and shift.
        self.write_slots: torch.Tensor | None = None
        self.query_lowest: list[int] = []
        self.query_shift: list[int] = []

    def chunk_limit(self) -> int:
        """Tokens the next forward may add. Later tokens of a chunk evict the oldest stored keys
        before attention runs, so the chunk must stop while the ring still holds every key its
        first token sees: T <= ring_size + 1 - (window tokens the policy holds at that token)."""
        if self.sinks < self.n_keep:
            return self.n_keep - self.sinks + self.ring_size  # sinks first, then a full ring
        first = self.window_count + 1 - (self.n_discard if self.window_count == self.window else 0)
        return self.ring_size + 1 - first

    def resized(self, headroom: int) -> "StreamingCache":
        """The same logical state in a new cache with ``headroom`` extra ring slots: sinks, visible
        window tokens (oldest first from the ring's start), positions, shift and sink frame. Tokens
        the policy no longer shows are not copied. Used to prefill a long input in chunks (with
        headroom) and then decode without it (no mask, no extra slots)."""
        layers, _, heads, _, dim = self.keys.shape
        new = StreamingCache(layers, heads, self.n_ctx, self.n_keep, self.n_discard, dim, self.keys.dtype,
                             self.device, self.layer_ropes, headroom)
        n, visible = self.n_keep, self.window_count if self.sinks == self.n_keep else 0
        first = self.ring_head + self.ring_count - visible  # oldest visible token, as a ring offset
        old_slots = n + (torch.arange(first, first + visible, device=self.device) % self.ring_size)
        for source, target in ((self.keys, new.keys), (self.values, new.values)):
            target[:, :, :, :n] = source[:, :, :, :n]  # [L, 1, Hkv, n_keep, D]
            target[:, :, :, n:n + visible] = source.index_select(3, old_slots)  # [L, 1, Hkv, visible, D]
        new.sink_keys.copy_(self.sink_keys)
        new.slot_positions[:n] = self.slot_positions[:n]
        new.slot_positions[n:n + visible] = self.slot_positions[old_slots]
        new.sink_frame, new.sinks, new.shift = self.sink_frame, self.sinks, self.shift
        new.ring_count = new.window_count = visible
        new.used = self.sinks + visible
        return new

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def reserve(self, positions: list[int]) -> None:
        """Place new tokens at absolute ``positions`` (consecutive), advancing the policy."""
        if len(positions) > self.chunk_limit():
            raise RuntimeError(f"a chunk of {len(positions)} tokens exceeds this cache's {self.chunk_limit()}")
        slots, lowest, shifts = [], [], []
        for position in positions:
            if self.sinks < self.n_keep:
                slots.append(self.sinks)
                self.sinks += 1
            else:
                if self.window_count == self.window:  # the policy drops the oldest n_discard
                    self.window_count -= self.n_discard
                    self.shift += self.n_discard
                self.window_count += 1
                if self.ring_count == self.ring_size:
                    self._evict_oldest()
                slots.append(self.n_keep + (self.ring_head + self.ring_count) % self.ring_size)
                self.ring_count += 1
            lowest.append(position - self.window_count + 1)
            shifts.append(self.shift)
        self.write_slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.slot_positions[self.write_slots] = torch.tensor(positions, device=self.device)
        self.used = max(self.used, max(slots) + 1)
        self.query_lowest, self.query_shift = lowest, shifts
        self.writes_sinks = min(slots) < self.n_keep
        if self.rope_groups and self.n_keep and shifts[0] == shifts[-1] != self.sink_frame:
            # One frame for the whole forward: rotate the sink slots of every layer at once (per rotary table).
            for rope, layers in self.rope_groups:
                self.keys[layers, :, :, : self.n_keep] = rope.rotate_by(self.sink_keys[layers], shifts[0])
            self.sink_frame = shifts[0]

    def _evict_oldest(self) -> None:
        self.slot_positions[self.n_keep + self.ring_head] = -1
        self.ring_head = (self.ring_head + 1) % self.ring_size
        self.ring_count -= 1

    def _all_visible(self) -> bool:
        """One query that sees every stored token: no mask needed."""
        return len(self.query_lowest) == 1 and self.ring_count == self.window_count and \
            self.used == self.sinks + self.ring_count

    def mask(self, query_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive [1, 1, T, used]: sinks up to the query's position, window keys in its range."""
        if self._all_visible():
            return None
        keys = self.slot_positions[: self.used][None, :]  # [1, used]
        queries = query_positions[:, None]  # [T, 1]
        lowest = torch.tensor(self.query_lowest, device=self.device)[:, None]  # [T, 1]
        is_sink = torch.arange(self.used, device=self.device)[None, :] < self.n_keep
        allowed = (keys >= 0) & (keys <= queries) & (is_sink | (keys >= lowest))  # [T, used]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))[None, None]  # [1, 1, T, used]

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Key minus query position [1, T, used], each in its frame: sinks see the query
        ``shift`` positions closer (ALiBi builds its bias from these)."""
        keys = self.slot_positions[: self.used][None, :]  # [1, used]
        queries = query_positions.reshape(-1)[:, None]  # [T, 1]
        distance = keys - queries  # [T, used]
        shifts = torch.tensor(self.query_shift, device=self.device)[:, None]  # [T, 1]
        distance[:, : self.n_keep] += shifts
        return distance[None]  # [1, T, used]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """Write k, v [1, Hkv, T, D] into the reserved slots, attend over the used slots."""
        keys, values = self.layer_keys[layer], self.layer_values[layer]
        keys.index_copy_(2, self.write_slots, k)
        values.index_copy_(2, self.write_slots, v)
        if self.writes_sinks:  # sinks are written while nothing has shifted: these are originals
            self.sink_keys[layer].copy_(keys[:, :, : self.n_keep])
        keys, values = keys[:, :, : self.used], values[:, :, : self.used]
        shifts = self.query_shift
        if self.layer_ropes is None or self.n_keep == 0 or shifts[0] == shifts[-1]:
            return attention(q, keys, values, mask, scale)  # sink slots already in the queries' frame
        # Queries with different shifts: each sees the original sinks rotated back by its own.
        deltas = torch.tensor(shifts, device=self.device).neg()
        q_sinks = self.layer_ropes[layer].rotate_by(q, deltas)
        n = self.n_keep
        return two_segment_attention(q_sinks, self.sink_keys[layer], values[:, :, :n],
                                     q, keys[:, :, n:], values[:, :, n:], mask, scale)


def _layers_by_rope(layer_ropes: list[RotaryEmbedding]) -> list[tuple[RotaryEmbedding, slice | torch.Tensor]]:
    """(rotary table, the layers that use it): a slice when one table serves every layer."""
    groups: dict[int, tuple[RotaryEmbedding, list[int]]] = {}
    for index, rope in enumerate(layer_ropes):
        groups.setdefault(id(rope), (rope, []))[1].append(index)
    if len(groups) == 1:
        return [(layer_ropes[0], slice(None))]
    return [(rope, torch.tensor(layers)) for rope, layers in groups.values()]
