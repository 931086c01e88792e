"""The streaming ("infinite") cache: attention sinks plus a ring-buffer window, batch 1.

Slots [0, n_keep) hold the first tokens of the stream (the attention sinks, StreamingLLM);
slots [n_keep, n_ctx) are a ring: new tokens go to the tail, and when the cache is full the
``n_discard`` oldest window tokens are dropped from the head. Nothing is ever moved or copied;
each slot remembers the absolute stream position of its token.

Position shifting without recomputation. After ``shift`` tokens have been discarded, the kept
window tokens must look ``shift`` positions closer to the sinks. Every key is stored rotated
(RoPE) at its absolute position a. Attention scores under RoPE depend only on the difference of
the two positions, so for window keys the shift cancels: (a_q - shift) - (a - shift) = a_q - a,
and the query rotated at its absolute position a_q is right as it is. Only the sink keys (which
keep positions 0..n_keep-1) need the query rotated back by ``shift``. So the cache rotates the
*query* once per segment instead of rewriting any cached key: a one-token-in, one-token-out
ring costs nothing extra per step. For ALiBi the same frames give effective key positions
(sinks: position + shift, window: position), from which the model builds its bias.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.attention import attention, two_segment_attention


class StreamingCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        n_ctx: int,
        n_keep: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        rotate_by: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
    ):
        shape = (num_layers, 1, num_kv_heads, n_ctx, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, Hkv, n_ctx, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, 1, Hkv, n_ctx, D]
        self.layer_keys = list(self.keys.unbind(0))
        self.layer_values = list(self.values.unbind(0))
        self.n_ctx, self.n_keep = n_ctx, n_keep
        self.window = n_ctx - n_keep
        self.rotate_by = rotate_by  # RoPE: rotate vectors by a position delta; None: no rotation
        self.slot_positions = torch.full((n_ctx,), -1, dtype=torch.long, device=device)  # -1 = empty
        self.sinks = 0  # sink slots filled
        self.ring_head = 0  # oldest window token, as an offset into the ring
        self.ring_count = 0  # window tokens held
        self.used = 0  # slots [0, used) have been written at least once
        self.shift = 0  # tokens discarded so far = positions the window has moved
        self.write_slots: torch.Tensor | None = None  # slots of the current forward's tokens
        self.has_holes = False  # some slot below ``used`` is empty

    @property
    def free(self) -> int:
        return (self.n_keep - self.sinks) + (self.window - self.ring_count)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def discard(self, count: int) -> None:
        """Drop the ``count`` oldest window tokens; the rest move ``count`` positions closer."""
        count = min(count, self.ring_count)
        slots = self.n_keep + (self.ring_head + torch.arange(count)) % self.window
        self.slot_positions[slots.to(self.slot_positions.device)] = -1
        self.ring_head = (self.ring_head + count) % self.window
        self.ring_count -= count
        self.shift += count
        self.has_holes = self.has_holes or count > 0

    def reserve(self, positions: torch.Tensor) -> torch.Tensor:
        """Assign slots to new tokens at absolute ``positions`` [T]; sinks first, then the ring tail."""
        T = positions.shape[0]
        if T > self.free:
            raise RuntimeError(f"streaming cache has {self.free} free slots, {T} needed")
        slots = []
        for _ in range(T):
            if self.sinks < self.n_keep:
                slots.append(self.sinks)
                self.sinks += 1
            else:
                slots.append(self.n_keep + (self.ring_head + self.ring_count) % self.window)
                self.ring_count += 1
        slot_index = torch.tensor(slots, dtype=torch.long, device=self.keys.device)
        self.slot_positions[slot_index] = positions
        self.used = max(self.used, max(slots) + 1)
        self.has_holes = bool((self.slot_positions[: self.used] < 0).any())
        self.write_slots = slot_index
        return slot_index

    def mask(self, query_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
        """Additive [1, 1, T, used]: a query sees filled slots at positions up to its own."""
        if query_positions.shape[0] == 1 and not self.has_holes:
            return None  # a single newest query sees every filled slot
        keys = self.slot_positions[: self.used]
        allowed = (keys[None, :] >= 0) & (keys[None, :] <= query_positions[:, None])  # [T, used]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, float("-inf"))[None, None]  # [1, 1, T, used]

    def key_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Effective key positions [1, used] in the window's frame: sinks are ``shift`` further
        back than their stored positions, window keys are where they were stored."""
        positions = self.slot_positions[: self.used].clone()
        positions[: self.n_keep] += self.shift
        return positions[None]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """Write k, v [1, Hkv, T, D] into the reserved slots, attend over the used slots."""
        keys, values = self.layer_keys[layer], self.layer_values[layer]
        keys.index_copy_(2, self.write_slots, k)
        values.index_copy_(2, self.write_slots, v)
        keys, values = keys[:, :, : self.used], values[:, :, : self.used]
        if self.rotate_by is None or self.shift == 0 or self.n_keep == 0:
            return attention(q, keys, values, mask, scale)
        q_sinks = self.rotate_by(q, -self.shift)  # the sinks' frame: the query is `shift` closer
        return two_segment_attention(q_sinks, q, keys, values, min(self.n_keep, self.used), mask, scale)
