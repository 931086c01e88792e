"""Infinite (streaming) generation: a policy of one sequence on a slot cache's per-sequence verbs.

A stream is one sequence of a slot cache (engine/slots.py: token at position p in slot
``table[p // block] * block + p % block``, in every attention kind) holding ``n_keep`` attention
sinks and a window of ``n_ctx - n_keep`` tokens. The policy is defined token by token
(tests/streaming_reference.py spells it out): when a token arrives to a full window, the
``n_discard`` oldest window tokens are dropped and the rest move ``n_discard`` positions closer
to the sinks. The same policy runs a stream in the engine (beside every other sequence of a
step: engine/stream_steps.py) and in tests alone (tests/stream_alone.py).

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
chunk of a fresh stream up to ``n_ctx + headroom``, at most 512). Each query of a chunk sees the
sinks plus its own last window, exactly as token by token (engine/stream_plan.py).

A stream holds the blocks of all its ``capacity`` positions, in every kind, from admission to
its end (the slots a verb hands back are taken again at once), so it never runs out of room.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import GenerationConfig
from ..errors import InvalidOptionError, PromptTooLongError
from ..layers.positions import longrope_switches
from .plan import layer_windows
from .slots import NO_BLOCK, SlotCache
from .stream_plan import StreamPlan

MAX_CHUNK = 512  # tokens per forward when feeding long inputs (the shift policy's headroom)

# Runs one forward of the stream's tokens through its plan (the re-evaluate policy's rebuild).
Forward = Callable[[list[int], StreamPlan], object]


def stream_capacity(config) -> int:
    """Cache slots a stream of a GenerationConfig holds: n_ctx, plus the shift policy's headroom."""
    return config.n_ctx + (min(config.n_ctx, MAX_CHUNK) if config.policy == "shift" else 0)


def check_streamable(cfg, n_ctx: int, policy: str) -> None:
    """The typed refusals of a policy the model cannot stream with."""
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


class StreamingPolicy:
    """One stream under ``policy`` "shift" or "reevaluate" on ``cache``'s blocks.

    Per chunk: ``chunk_size`` -> ``begin`` (applies the policy, returns the forward's plan) ->
    the forward -> ``finish``. ``next_position``: tokens fed in the whole stream. ``headroom``
    (shift): slots past ``n_ctx``, the longest chunk per forward and the tokens between two
    compactions."""

    def __init__(self, model, cache: SlotCache, n_ctx: int, n_keep: int, n_discard: int, policy: str = "shift",
                 headroom: int | None = None):
        cfg = model.config
        check_streamable(cfg, n_ctx, policy)
        self.model, self.cache, self.policy = model, cache, policy
        self.n_ctx, self.n_keep, self.n_discard = n_ctx, n_keep, n_discard
        self.window = n_ctx - n_keep
        self.headroom = (headroom or min(n_ctx, MAX_CHUNK)) if policy == "shift" else 0
        self.capacity = n_ctx + self.headroom  # positions the sequence may reach
        self.table: list[int] = []  # the stream's blocks (taken by ``admit``)
        self.windows = layer_windows(cfg)
        self.score_bias = model.alibi_bias if cfg.position_kind == "alibi" else None
        self.ropes = model.layer_ropes if cfg.position_kind == "rope" else None
        self.rope_groups = {kind: self._rope_groups(kind) for kind in [None, *cache.windows]}
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

    # -- blocks ------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.cache.pool.blocks_for(self.capacity)

    def check_fits(self) -> None:
        """A stream that could never fit the cache is refused before it waits for room."""
        if self.num_blocks > self.cache.pool.num_blocks or any(
                self.num_blocks > pool.num_blocks for pool in self.cache.window_pools.values()):
            raise PromptTooLongError(
                f"a stream of n_ctx={self.n_ctx} needs {self.capacity} cache slots (n_ctx plus its "
                f"headroom) but the engine's cache holds {self.cache.capacity_tokens}: give the engine more "
                "cache_tokens or lower n_ctx")

    def can_admit(self) -> bool:
        need = self.num_blocks
        return self.cache.pool.num_free >= need and all(
            pool.reserved + need <= pool.num_blocks for pool in self.cache.window_pools.values())

    def admit(self) -> None:
        """Take the blocks of every position the stream may reach (reserved in the sliding kinds)."""
        self.table = self.cache.take(self.capacity)
        for w, pool in self.cache.window_pools.items():
            self.table.reserved[w] = self.num_blocks
            pool.reserved += self.num_blocks

    def adopt(self, table, tokens: list[int]) -> bool:
        """Go on from a plain sequence holding ``tokens`` (at most ``n_ctx``) at positions 0.. in
        ``table`` (a chat past its context: a policy switch, nothing recomputed) -> False, changing
        nothing, when it cannot: a sliding kind already handed some of them back, or no room."""
        cache, need = self.cache, self.num_blocks
        if len(tokens) > self.n_ctx or any(NO_BLOCK in blocks[: cache.pool.blocks_for(len(tokens))]
                                           for blocks in getattr(table, "windows", {}).values()):
            return False
        if cache.pool.num_free < need - len(table) or any(
                pool.reserved - table.reserved.get(w, 0) + need > pool.num_blocks
                for w, pool in cache.window_pools.items()):
            return False
        for w, pool in cache.window_pools.items():
            pool.reserved += need - table.reserved.get(w, 0)
            table.reserved[w] = need
        # Its blocks will be rewritten in place: no later request may share them (a block shared
        # already is copied before any write).
        cache.pool.unname(table)
        for w, pool in cache.window_pools.items():
            pool.unname(table.windows[w])
        self.table, self.end = table, len(tokens)
        self._hold_all()
        self.next_position, self.sinks = len(tokens), min(len(tokens), self.n_keep)
        self.window_count = len(tokens) - self.sinks
        self.tokens = list(tokens) if self.policy == "reevaluate" else []
        return True

    def release(self) -> None:
        if self.table:
            self.cache.release(self.table)
            self.table = []

    def _hold_all(self) -> None:
        """Take back at once the blocks a ``seq_rm`` handed back (the stream keeps its capacity)."""
        self.table = self.cache.writable(self.table, self.end, self.capacity)

    # -- chunks ------------------------------------------------------------------------------------
    def chunk_size(self, remaining: int) -> int:
        """Tokens of the next forward, of ``remaining`` to feed."""
        if self.policy == "shift":
            limit = min(self.capacity, MAX_CHUNK) if self.end == 0 else self.headroom  # a fresh stream: all of it
            return min(remaining, limit)
        end = self.end if self.end < self.n_ctx else self.n_ctx - self.n_discard  # after the rebuild
        return min(remaining, self.n_ctx - end, MAX_CHUNK)

    def begin(self, chunk: list[int], forward: Forward) -> StreamPlan:
        """Apply the policy before ``chunk`` runs -> the plan of its forward (``forward`` runs the
        re-evaluate policy's rebuild)."""
        if self.policy == "shift":
            return self._shift_plan(len(chunk))
        if self.end == self.n_ctx:
            self._rebuild(forward)
        self.tokens += chunk
        return self.plan(len(chunk))

    def finish(self, count: int) -> None:
        """The forward of ``count`` tokens ran."""
        self.end += count
        self.next_position += count

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

    def _shift_plan(self, count: int) -> StreamPlan:
        lowest, shifts = self._advance(count)
        first = shifts[0] - self.compacted  # where the first query's frame puts the sinks
        if self.sinks and first != self.sink_start:  # sinks up over the dropped tokens
            self._move_sinks(first)
        self.sink_start = first
        if first and self.end + count > self.capacity:  # compaction: everything held back to position 0
            rotate = self._rotate if self.ropes is not None else None
            self.table = self.cache.seq_add(self.table, first, self.end, -first, rotate)
            self.table = self.cache.seq_rm(self.table, self.end - first)
            self.compacted, self.end, self.sink_start = self.compacted + first, self.end - first, 0
            self._hold_all()
        base = self.compacted
        return self.plan(count, lowest=[p - base for p in lowest], corrections=[s - shifts[0] for s in shifts])

    def _move_sinks(self, to: int) -> None:
        """``seq_add(table, sink_start, sink_start + sinks, to - sink_start)`` with the K-shift, done
        for every layer of a kind at once (one rotation per RoPE table instead of a dozen small ops
        per layer: with ``n_discard=1`` this runs at every token). Equal to SlotCache.seq_add (tested)."""
        cache, delta = self.cache, to - self.sink_start
        self.table = cache.writable(self.table, to, to + self.sinks)
        device = cache.keys.device
        for kind, (keys, values) in self._kind_buffers().items():
            source = torch.tensor(cache.slot_ids(self.table, self.sink_start, self.sink_start + self.sinks, kind),
                                  device=device)
            target = torch.tensor(cache.slot_ids(self.table, to, to + self.sinks, kind), device=device)  # [n_keep]
            moved = keys.index_select(1, source)  # [L, n_keep, Hkv, D] (a copy: the ranges may overlap)
            for rope, layers in self.rope_groups[kind]:
                moved[layers] = rope.rotate_by(moved[layers], delta)  # [L', n_keep, Hkv, D]: rotations broadcast
            keys.index_copy_(1, target, moved)
            values.index_copy_(1, target, values.index_select(1, source))

    def _kind_buffers(self) -> dict[int | None, tuple[torch.Tensor, torch.Tensor]]:
        """Each attention kind's K and V buffers [L_kind, slots, Hkv, D]."""
        cache = self.cache
        buffers = {None: (cache.keys, cache.values)}
        for w in cache.windows:
            buffers[w] = (cache.window_keys[w], cache.window_values[w])
        return buffers

    def _rope_groups(self, kind: int | None) -> list[tuple[object, slice | list[int]]]:
        """(rotary table, the kind's layers using it, as indices into the kind's buffers): one slice
        when every layer of the kind shares one table."""
        if self.ropes is None:
            return []
        layers = [i for i, w in enumerate(self.cache.layer_windows) if w == kind]
        groups: dict[int, tuple[object, list[int]]] = {}
        for local, layer in enumerate(layers):
            groups.setdefault(id(self.ropes[layer]), (self.ropes[layer], []))[1].append(local)
        if len(groups) == 1:
            return [(next(iter(groups.values()))[0], slice(None))]
        return list(groups.values())

    def _rotate(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        """seq_add's K-shift (compaction): keys [1, Hkv, N, D] rotated by ``delta``, the layer's table."""
        return self.ropes[layer].rotate_by(keys, delta)

    # -- the re-evaluate policy --------------------------------------------------------------------
    def _rebuild(self, forward: Forward) -> None:
        """Keep the sinks (their K/V depend on nothing else) and all but the ``n_discard`` oldest
        window tokens: seq_rm of the window, then prefill the kept ones at fresh positions."""
        kept = self.tokens[self.n_keep + self.n_discard :]
        self.table = self.cache.seq_rm(self.table, self.n_keep)
        self.tokens, self.end = self.tokens[: self.n_keep], self.n_keep
        self._hold_all()
        self.rebuilds += 1
        for begin in range(0, len(kept), MAX_CHUNK):
            piece = kept[begin : begin + MAX_CHUNK]
            self.tokens += piece
            forward(piece, self.plan(len(piece)))
            self.end += len(piece)

    # -- one forward -------------------------------------------------------------------------------
    def plan(self, count: int, lowest: list[int] | None = None, corrections: list[int] | None = None) -> StreamPlan:
        """The plan of ``count`` tokens at positions [end, end + count) (``lowest`` None: every key
        held is visible, from the sinks on)."""
        start = self.end
        self.table = self.cache.writable(self.table, start, start + count)
        positions = torch.arange(start, start + count, device=self.model.device)  # [T]
        if lowest is None or (count == 1 and not any(corrections)):
            lowest = corrections = None  # one frame, nothing dropped inside: plain causal attention
        return StreamPlan(self, positions, lowest, corrections)


def new_stream(engine, config: GenerationConfig) -> StreamingPolicy:
    """The policy of a request with ``n_ctx`` on ``engine``'s cache (refused at once if the model
    cannot stream that way or the cache could never hold it)."""
    stream = StreamingPolicy(engine.model, engine.cache, config.n_ctx, config.n_keep, config.discard_count,
                             config.policy)
    stream.check_fits()
    return stream
