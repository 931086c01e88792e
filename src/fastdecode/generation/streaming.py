"""Infinite (streaming) generation on the slot cache's per-sequence verbs.

A stream is one sequence of a slot cache (engine/slots.py: token at position p in slot
``table[p // block] * block + p % block``) holding ``n_keep`` attention sinks and a window of
``n_ctx - n_keep`` tokens. The policy is defined token by token (tests/streaming_reference.py
spells it out): when a token arrives to a full window, the ``n_discard`` oldest window tokens
are dropped and the rest move ``n_discard`` positions closer to the sinks.

* ``reevaluate``: ``seq_rm`` of the window, then one prefill of the newest tokens at fresh
  positions (the sinks' K/V depend only on the sinks, so they stay). Works for every position
  scheme, learned absolute positions included.
* ``shift`` (llama.cpp's context shift, ``seq_rm`` + ``seq_add``), amortized. Only position
  *differences* matter (RoPE scores, ALiBi, sliding windows), so moving the window ``d``
  positions down equals moving the ``n_keep`` sinks ``d`` positions up: ``seq_add(+d)`` on the
  sinks, whose new slots are exactly those of the dropped tokens (they are overwritten: the
  remove), O(n_keep) per drop instead of re-rotating the whole window. What the stream holds is
  then always the contiguous range ``[D, end)`` (D: tokens dropped since the last compaction),
  so a decode step is one plain attention over it, without a mask. The sequence has ``headroom``
  slots past ``n_ctx``; when they are used up, one compaction ``seq_add(-D)`` + ``seq_rm`` of
  the tail (llama.cpp's verbs, literally) moves everything back to position 0: one O(n_ctx)
  K-rotation per ``headroom`` tokens.

Chunks. A long input runs ``headroom`` tokens per forward whatever ``n_discard`` is (the first
chunk of a fresh stream up to ``n_ctx + headroom``, at most 512). Each query
of a chunk sees the sinks plus its own last window, exactly as token by token: window keys it
no longer holds are masked (they stay in their slots until a later forward overwrites them),
and when drops happen inside the chunk, query t's sinks sit ``c_t`` positions too far (the sinks
were placed for the chunk's first query): for RoPE the query is rotated back by ``c_t`` for the
sink segment (scores depend only on position differences) under one softmax with the window
segment (``two_segment_attention``); for ALiBi and window masks the sink distances are
corrected by ``c_t``.

Cost, measured side by side against the dedicated sinks + ring cache this replaces (SmolLM2-135M,
n_ctx 256, n_keep 4, n_discard 1, one thread, alternating processes, CPU-time medians on a loaded
machine): first token after a 1,680-token prompt 1.03x, decode past n_ctx 1.03x, both within the
noise. Re-rotating the window at every token (the literal llama.cpp shift with n_discard=1) and one
token per forward past n_ctx were what made the first attempt 15-20x slower on that prompt.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import GenerationConfig
from ..engine.plan import layer_windows, no_distances, position_mask
from ..engine.slots import BLOCK_SIZE, SlotCache
from ..errors import InvalidOptionError
from ..layers.attention import attention, two_segment_attention
from ..layers.positions import longrope_switches
from ..layers.products import Products

MAX_CHUNK = 512  # tokens per forward when feeding long inputs (the shift policy's headroom)


class StreamEngine:
    """One stream (batch of one) under ``policy`` "shift" or "reevaluate".

    ``feed_chunks`` runs tokens through the policy; ``prefill`` / ``decode`` / ``drop_rows`` are
    the interface of generation/step.py's engines, so the decode loop and the scorer use it
    unchanged. ``next_position``: tokens fed in the whole stream. ``headroom`` (shift): slots past
    ``n_ctx``, the longest chunk per forward and the tokens between two compactions."""

    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int, policy: str = "shift",
                 headroom: int | None = None):
        cfg = model.config
        if policy == "shift" and cfg.position_kind == "learned":
            raise InvalidOptionError(
                f"{cfg.architecture} uses learned absolute positions, which cannot be shifted: "
                "use policy='reevaluate'"
            )
        if policy == "reevaluate" and cfg.position_kind == "learned" and n_ctx > cfg.max_position_embeddings:
            raise InvalidOptionError(
                f"n_ctx={n_ctx} exceeds the {cfg.max_position_embeddings} learned positions of {cfg.architecture}"
            )
        if longrope_switches(cfg.rope_scaling) and n_ctx > cfg.max_position_embeddings:
            raise InvalidOptionError(
                f"n_ctx={n_ctx} exceeds the {cfg.max_position_embeddings} positions {cfg.architecture}'s LongRoPE "
                "runs with its short factors (past them transformers switches factors and recomputes the cache)")
        self.model, self.policy = model, policy
        self.n_ctx, self.n_keep, self.n_discard = n_ctx, n_keep, n_discard
        self.window = n_ctx - n_keep
        self.headroom = (headroom or min(n_ctx, MAX_CHUNK)) if policy == "shift" else 0
        self.capacity = n_ctx + self.headroom  # positions the sequence may reach
        self.cache = SlotCache(cfg.num_layers, -(-self.capacity // BLOCK_SIZE), cfg.num_kv_heads, cfg.head_dim,
                               model.dtype, model.device, BLOCK_SIZE)
        self.table = self.cache.pool.take(self.cache.pool.num_blocks)  # the stream's blocks
        self.windows = layer_windows(cfg)
        self.score_bias = model.alibi_bias if cfg.position_kind == "alibi" else None
        self.ropes = model.layer_ropes if cfg.position_kind == "rope" else None
        self.rope_groups = self._rope_groups(self.ropes)
        self.next_position = 0  # tokens fed in the whole stream
        # The policy, token by token (stream positions).
        self.sinks = 0  # sinks held (< n_keep only at the start)
        self.window_count = 0  # window tokens held
        self.shift = 0  # window tokens dropped so far
        # The layout (sequence positions): stream position a sits at a - compacted; the sinks sit
        # at [sink_start, sink_start + sinks); ``end``: the next free position.
        self.compacted = 0
        self.sink_start = 0
        self.end = 0
        self.tokens: list[int] = []  # reevaluate: the ids held, in order
        self.rebuilds = 0

    # -- feeding -----------------------------------------------------------------------------------
    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool, prompt: bool) -> Iterator[torch.Tensor]:
        """Feed tokens [N] through the policy; yield logits per chunk ([T, V], or [1, V] for the
        chunk's last token when not ``all_logits``). ``prompt``: the tokens' rows take the prompt
        rows' exact products (layers/products.py), else the generated rows' kernels."""
        done = 0
        while done < tokens.shape[0]:
            if self.policy == "shift":
                limit = min(self.capacity, MAX_CHUNK) if self.end == 0 else self.headroom  # a fresh stream: all of it
                size = min(tokens.shape[0] - done, limit)
                yield self._shift_forward(tokens[done : done + size].tolist(), all_logits, prompt)
            else:
                if self.end == self.n_ctx:
                    self._rebuild(prompt)
                size = min(tokens.shape[0] - done, self.n_ctx - self.end, MAX_CHUNK)
                chunk = tokens[done : done + size].tolist()
                self.tokens += chunk
                yield self._forward(chunk, self._plan(len(chunk), prompt), all_logits)
            self.next_position += size
            done += size

    def feed(self, tokens: torch.Tensor, prompt: bool) -> torch.Tensor:
        """Feed tokens [N] (``prompt``: as ``feed_chunks``); logits of the last one [V]."""
        logits = None
        for logits in self.feed_chunks(tokens, all_logits=False, prompt=prompt):
            pass
        return logits[-1]

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] != 1:
            raise InvalidOptionError("streaming generation runs one sequence at a time")
        return self.feed(tokens[0][valid[0]], prompt=True)[None]  # [1, V]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.feed(tokens, prompt=False)[None]  # [1, V]

    def drop_rows(self, rows: torch.Tensor) -> None:
        pass  # a single sequence: when it finishes, the loop ends

    # -- the shift policy --------------------------------------------------------------------------
    def _advance(self, count: int) -> tuple[list[int], list[int]]:
        """The policy for ``count`` new tokens -> each one's (first visible window position, tokens
        dropped before it), in stream positions."""
        lowest, shifts = [], []
        for position in range(self.next_position, self.next_position + count):
            if self.sinks < self.n_keep:
                self.sinks += 1
            else:
                if self.window_count == self.window:  # drop the oldest n_discard
                    self.window_count -= self.n_discard
                    self.shift += self.n_discard
                self.window_count += 1
            lowest.append(position - self.window_count + 1)
            shifts.append(self.shift)
        return lowest, shifts

    def _shift_forward(self, chunk: list[int], all_logits: bool, prompt: bool) -> torch.Tensor:
        lowest, shifts = self._advance(len(chunk))
        first = shifts[0] - self.compacted  # where the first query's frame puts the sinks
        if self.sinks and first != self.sink_start:  # sinks up over the dropped tokens
            self._move_sinks(first)
        self.sink_start = first
        if first and self.end + len(chunk) > self.capacity:  # compaction: everything held back to position 0
            rotate = self._rotate if self.ropes is not None else None
            self.table = self.cache.seq_add(self.table, first, self.end, -first, rotate)
            self.table = self.cache.seq_rm(self.table, self.end - first)
            self.compacted, self.end, self.sink_start = self.compacted + first, self.end - first, 0
        base = self.compacted
        plan = self._plan(len(chunk), prompt, lowest=[p - base for p in lowest],
                          corrections=[s - shifts[0] for s in shifts])
        return self._forward(chunk, plan, all_logits)

    def _move_sinks(self, to: int) -> None:
        """``seq_add(table, sink_start, sink_start + sinks, to - sink_start)`` with the K-shift, done
        for every layer at once (one rotation per RoPE table instead of a dozen small ops per
        layer: with ``n_discard=1`` this runs at every token). Equal to SlotCache.seq_add (tested)."""
        cache, delta = self.cache, to - self.sink_start
        self.table = cache.writable(self.table, to, to + self.sinks)
        device = cache.keys.device
        source = torch.tensor(cache.slot_ids(self.table, self.sink_start, self.sink_start + self.sinks), device=device)
        target = torch.tensor(cache.slot_ids(self.table, to, to + self.sinks), device=device)  # [n_keep]
        moved = cache.keys.index_select(1, source)  # [L, n_keep, Hkv, D] (a copy: the ranges may overlap)
        for rope, layers in self.rope_groups:
            moved[layers] = rope.rotate_by(moved[layers], delta)  # [L', n_keep, Hkv, D]: rotations broadcast
        cache.keys.index_copy_(1, target, moved)
        cache.values.index_copy_(1, target, cache.values.index_select(1, source))

    @staticmethod
    def _rope_groups(ropes) -> list[tuple[object, slice | list[int]]]:
        """(rotary table, the layers using it): one slice when every layer shares one table."""
        if ropes is None:
            return []
        groups: dict[int, tuple[object, list[int]]] = {}
        for layer, rope in enumerate(ropes):
            groups.setdefault(id(rope), (rope, []))[1].append(layer)
        if len(groups) == 1:
            return [(ropes[0], slice(None))]
        return list(groups.values())

    def _rotate(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """seq_add's K-shift (compaction): keys [1, Hkv, N, D] rotated by ``delta``, the layer's table."""
        return self.ropes[layer].rotate_by(keys, delta)

    # -- the re-evaluate policy --------------------------------------------------------------------
    def _rebuild(self, prompt: bool) -> None:
        """Keep the sinks (their K/V depend on nothing else) and all but the ``n_discard`` oldest
        window tokens: seq_rm of the window, then prefill the kept ones at fresh positions."""
        kept = self.tokens[self.n_keep + self.n_discard :]
        self.table = self.cache.seq_rm(self.table, self.n_keep)
        self.tokens, self.end = self.tokens[: self.n_keep], self.n_keep
        self.rebuilds += 1
        for begin in range(0, len(kept), MAX_CHUNK):
            piece = kept[begin : begin + MAX_CHUNK]
            self.tokens += piece
            self._forward(piece, self._plan(len(piece), prompt), all_logits=False)

    # -- one forward -------------------------------------------------------------------------------
    def _plan(self, count: int, prompt: bool, lowest: list[int] | None = None,
              corrections: list[int] | None = None) -> "StreamPlan":
        """The plan of ``count`` tokens at positions [end, end + count) (``lowest`` None: every key
        held is visible, from the sinks on), prompt rows or generated ones (``prompt``)."""
        device = self.model.device
        start = self.end
        self.table = self.cache.writable(self.table, start, start + count)
        positions = torch.arange(start, start + count, device=device)  # [T]
        if lowest is None or (count == 1 and not any(corrections)):
            lowest = corrections = None  # one frame, nothing dropped inside: plain causal attention
        products = Products.of_rows(prompt, torch.get_num_threads(), device)  # big ops: the caller's threads
        return StreamPlan(self, positions, lowest, corrections, products)

    def _forward(self, chunk: list[int], plan: "StreamPlan", all_logits: bool) -> torch.Tensor:
        device = self.model.device
        tokens = torch.tensor([chunk], device=device)  # [1, T]
        logits = self.model.forward(tokens, plan.positions[None], plan, None, all_logits)[0]
        self.end += len(chunk)
        return logits


class StreamPlan:
    """The cache view of one forward of a stream: writes K/V into the stream's slots and attends
    over what each query holds (the model calls ``attend`` / ``relative_positions``).

    Keys are read from the sinks' first position on (``[sink_start, end + T)``). ``lowest`` [T]:
    each query's first visible window position (None: all held keys visible); ``corrections`` [T]:
    how many positions query t sees its sinks closer than they sit (None: 0)."""

    def __init__(self, stream: StreamEngine, positions: torch.Tensor, lowest: list[int] | None,
                 corrections: list[int] | None, products: Products):
        self.stream, self.cache, self.positions = stream, stream.cache, positions
        self.products = products  # the rows' roles and the thread budget
        device = positions.device
        self.key_start = stream.sink_start
        end = stream.end + positions.shape[0]
        size = self.cache.block_size
        first_block, num_blocks = self.key_start // size, self.cache.pool.blocks_for(end)
        blocks = stream.table[first_block:num_blocks]
        self.offset = self.key_start - first_block * size  # first key inside the gathered blocks
        self.num_keys = end - self.key_start
        # One stream's blocks in order (as its table stays): read the layer buffers as views.
        self.slot_range = (blocks[0] * size + self.offset, blocks[0] * size + self.offset + self.num_keys) \
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))) else None
        self.block_table = torch.tensor([blocks], dtype=torch.long, device=device)  # [1, n]
        self.write_slots = torch.tensor(self.cache.slot_ids(stream.table, stream.end, end), device=device)  # [T]
        self.sinks = stream.sinks
        self.lowest = None if lowest is None else torch.tensor(lowest, device=device)
        self.corrections = None if corrections is None else torch.tensor(corrections, device=device)
        self.split = (stream.ropes is not None and self.sinks > 0 and corrections is not None
                      and any(corrections))  # RoPE with per-query sink frames: two segments
        self.score_bias, self.dtype = stream.score_bias, stream.model.dtype
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        return no_distances(query_positions)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float, softcap: float | None = None) -> torch.Tensor:
        """q [1, H, T, D]; k, v [1, Hkv, T, D] -> [1, H, T, D] (``mask`` unused: the plan builds its own)."""
        keys, values = self.cache.layer_keys[layer], self.cache.layer_values[layer]
        keys.index_copy_(0, self.write_slots, k[0].transpose(0, 1))  # [T, Hkv, D]
        values.index_copy_(0, self.write_slots, v[0].transpose(0, 1))
        kg, vg = self._read(keys), self._read(values)  # [1, Hkv, S, D]
        mask = self._mask(self.stream.windows[layer])
        if not self.split:
            return attention(q, kg, vg, mask, scale, softcap, threads=self.products.threads)
        n = self.sinks
        q_sinks = self.stream.ropes[layer].rotate_by(q, self.corrections.neg())  # sinks seen c_t closer
        return two_segment_attention(q_sinks, kg[:, :, :n], vg[:, :, :n], q, kg[:, :, n:], vg[:, :, n:], mask, scale,
                                     softcap)

    def _read(self, buffer: torch.Tensor) -> torch.Tensor:
        """A layer's K or V [slots, Hkv, D] -> the stream's keys [1, Hkv, S, D]."""
        if self.slot_range is not None:
            return buffer[self.slot_range[0] : self.slot_range[1]].transpose(0, 1)[None]  # [S, Hkv, D] -> [1, Hkv, S, D]
        gathered = self.cache.gather(buffer, self.block_table)  # [1, Hkv, n * block, D]
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


def streaming_engine(model, config: GenerationConfig) -> StreamEngine:
    """The stream for a config with ``n_ctx`` set."""
    return StreamEngine(model, config.n_ctx, config.n_keep, config.discard_count, config.policy)
