"""The slot cache: K/V storage in fixed-size blocks owned by sequences, layered by attention kind,
with a prefix cache.

Layers come in attention *kinds*: full (every earlier position) and sliding (the last ``w``
positions; one kind per distinct window). Each kind has its own block pool and, per layer of the
kind, one K and one V buffer ``[blocks * block_size, Hkv, D]`` (a flat array of slots,
token-major, only the KV heads the model has). Token ``p`` of a sequence belongs to *logical
block* ``p // block_size`` in every kind, at offset ``p % block_size``; a sequence's
``BlockTable`` names, per kind, the block holding each logical block (the list itself is the full
kind's, so a model without sliding layers has exactly the plain tables of before). Nothing is
left-padded: a sequence attends to its own slots only, whatever else is in the pool.

Layered storage (as llama.cpp's SWA cache, with vLLM's per-kind block tables): a query at position
``q`` of a sliding layer sees keys ``> q - w`` only, so once a sequence's next queries are at
``>= start``, its blocks wholly before ``start - w + 1`` are never read again. ``slide`` hands them
back to their pool at once (the table keeps ``NO_BLOCK`` there), so a sliding kind holds at most
``ceil((w + chunk - 1) / block) + 1`` blocks per sequence, whatever the context length: memory
independent of the context for local layers, full storage for global ones. A full kind's blocks
are reserved for the whole request at admission (``allocate``), as before; a sliding kind's blocks
are taken as tokens are written (``writable``) within a *reservation* made at admission
(``reservation``: the most the sequence can hold at once), so a running sequence never runs out
and nothing is preempted. The sum of the reservations bounds the blocks held (a shared block is
counted by each holder), so the free list always has room for what a reservation still allows.
Attention of a sliding layer gathers only the blocks of its window (``window_tables``), so its
cost per step does not grow with the context either.

Prefix cache (as nano-vllm's block manager): a *full* block is named by a hash chain over token
ids, ``h_i = hash(h_{i-1}, tokens of block i)``, in every kind (a sliding kind's block of logical
index i carries the same name). A new sequence whose first blocks carry the same tokens as blocks
already computed shares them (reference counts) and only runs the model on the rest. A block whose
last owner left goes back to its free list but keeps its name until it is reused (least recently
freed first), so a later request can still revive it; a sliding block that slid out of its
sequence's window is freed the same way. The rule with sliding layers is exact: a hit of ``m``
blocks is used only if every sliding kind still holds (or can revive) the blocks of the last
``w - 1`` positions before ``m * block`` (what the first query after the hit attends to), else a
shorter hit is tried, down to none. Re-running only the last window of a longer hit would not be
exact: the hidden states a sliding layer reads depend, layer by layer, on ``w - 1`` more positions
each (Gemma 3's 15 sliding layers of 512 reach 7,665 positions back), so a partial re-run differs
from a cold run. Reuse is by token ids, never by text; a hit is confirmed by comparing the ids.

Per-sequence cache verbs (llama.cpp's ``seq_cp / seq_rm / seq_keep / seq_add``) act on every kind:
blocks are shared by reference and copied on the first write into a shared one (``writable``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import PromptTooLongError
from .blocks import (BLOCK_SIZE, NO_BLOCK, BlockPool, BlockTable, PooledBuffers, first_visible_block,
                     sliding_blocks)
from .lazy_zeros import zeroed

__all__ = ["BLOCK_SIZE", "NO_BLOCK", "BlockPool", "BlockTable", "SlotCache", "check_fits", "first_visible_block"]


class SlotCache(PooledBuffers):
    """The K/V buffers of every attention kind behind their ``BlockPool``s.

    ``layer_windows``: each layer's window (None: full attention; default: every layer full, one
    kind). The full kind has ``num_blocks`` blocks; each sliding kind ``window_blocks`` (default
    ``num_blocks``). ``layer_keys[i]`` / ``layer_values[i]``: layer i's buffer ``[slots, Hkv, D]`` in its kind."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = BLOCK_SIZE, layer_windows: list[int | None] | None = None,
                 window_blocks: int | None = None):
        self.layer_windows = list(layer_windows) if layer_windows is not None else [None] * num_layers
        self.pool = BlockPool(num_blocks, block_size)
        self.device = device
        windows = sorted({w for w in self.layer_windows if w is not None})
        self.window_pools = {w: BlockPool(window_blocks or num_blocks, block_size) for w in windows}

        def buffers(layers: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
            shape = (layers, blocks * block_size, num_kv_heads, head_dim)
            # Zeros, not empty: a masked slot still meets a zero probability, and 0 * NaN would be NaN.
            return zeroed(shape, dtype, device), zeroed(shape, dtype, device)

        self.layer_keys: list[torch.Tensor] = [None] * num_layers  # type: ignore[list-item]
        self.layer_values: list[torch.Tensor] = [None] * num_layers  # type: ignore[list-item]
        self.keys, self.values = self._place(None, buffers, num_blocks)  # full kind: [L_full, slots, Hkv, D]
        self.window_keys, self.window_values = {}, {}
        for w, pool in self.window_pools.items():
            self.window_keys[w], self.window_values[w] = self._place(w, buffers, pool.num_blocks)

    def _place(self, window: int | None, buffers, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers = [i for i, w in enumerate(self.layer_windows) if w == window]
        keys, values = buffers(len(layers), blocks)  # [L_kind, slots, Hkv, D]
        for layer, k, v in zip(layers, keys.unbind(0), values.unbind(0)):
            self.layer_keys[layer], self.layer_values[layer] = k, v
        return keys, values

    @property
    def windows(self) -> list[int]:
        """The sliding kinds' windows (empty: every layer attends fully)."""
        return list(self.window_pools)

    def pool_of(self, window: int | None) -> BlockPool:
        return self.pool if window is None else self.window_pools[window]

    def slot_ids(self, table: list[int], start: int, end: int, window: int | None = None) -> list[int]:
        """Slots of a sequence's tokens [start, end) in kind ``window`` (host list)."""
        size = self.block_size
        blocks = table if window is None else table.windows[window]  # type: ignore[attr-defined]
        return [blocks[p // size] * size + p % size for p in range(start, end)]

    def window_tables(self, tables: list[list[int]], starts: list[int], ends: list[int], window: int,
                      num_blocks: int | None = None, common_first: bool = False,
                      device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """What queries at [start, end) of each row read in sliding kind ``window``: its blocks from
        the first visible one (``common_first``: the rows' earliest, for every row) -> (tables
        [B, n], position of each row's first key [B, 1]). Past a row's blocks, or slid out: block
        0, whose slots the position mask hides. ``num_blocks``: a fixed n; ``device``: where the two
        tensors are made (default: the cache's)."""
        size = self.block_size
        firsts = [first_visible_block(window, start, size) for start in starts]
        if common_first:
            firsts = [min(firsts)] * len(firsts)
        rows = [t.windows[window][first : -(-end // size)] for t, first, end in zip(tables, firsts, ends)]
        n = num_blocks if num_blocks is not None else max(len(row) for row in rows)
        padded = [[max(b, 0) for b in row[:n]] + [0] * (n - len(row[:n])) for row in rows]  # NO_BLOCK -> 0
        device = self.keys.device if device is None else device
        key_starts = torch.tensor(firsts, dtype=torch.long, device=device)[:, None] * size  # [B, 1]
        return torch.tensor(padded, dtype=torch.long, device=device), key_starts

    def gather(self, layer_buffer: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """A layer's K or V [slots, Hkv, D] read through block tables [B, n] -> [B, Hkv, n * block, D]
        (key j of a row is the j-th slot of its table). Whole blocks are copied with ``index_select``:
        many times faster on CPU than indexing slot by slot."""
        B, n = block_table.shape
        _, Hkv, D = layer_buffer.shape
        blocks = layer_buffer.view(-1, self.block_size, Hkv, D)  # [num_blocks, block, Hkv, D]
        rows = blocks.index_select(0, block_table.flatten())  # [B*n, block, Hkv, D]
        return rows.view(B, n * self.block_size, Hkv, D).transpose(1, 2)  # [B, S, Hkv, D] -> [B, Hkv, S, D]

    @property
    def nbytes(self) -> int:
        return sum(self.nbytes_by_kind().values())

    def nbytes_by_kind(self) -> dict[str, int]:
        """Bytes of the K/V buffers of each kind: {"full": ..., "sliding (window w)": ...}."""
        sizes = {"full": self.keys.nbytes + self.values.nbytes}
        for w in self.window_pools:
            sizes[f"sliding (window {w})"] = self.window_keys[w].nbytes + self.window_values[w].nbytes
        return sizes

    @property
    def block_nbytes(self) -> int:
        """K and V bytes of one logical block in every layer (a block in each kind)."""
        size, per_slot = self.block_size, self.keys[0, 0].nbytes if self.keys.shape[0] else 0
        total = 2 * size * per_slot * self.keys.shape[0]
        for w in self.window_pools:
            total += 2 * size * self.window_keys[w][0, 0].nbytes * self.window_keys[w].shape[0]
        return total

    def held_tokens(self) -> dict[str, int]:
        """Slots in use now per kind (blocks held x block size): what the layered cache saves."""
        held = {"full": self.pool.num_used * self.block_size}
        for w, pool in self.window_pools.items():
            held[f"sliding (window {w})"] = pool.num_used * self.block_size
        return held

    # -- admission: full blocks for the whole request, sliding blocks within a reservation ---------
    def reservation(self, window: int, total_tokens: int, chunk: int) -> int:
        """The most blocks of sliding kind ``window`` a sequence of ``total_tokens`` running at most
        ``chunk`` tokens per step holds at once: those its queries can see plus those it writes."""
        return min(self.pool.blocks_for(total_tokens), -(-(window + chunk - 1) // self.block_size) + 1)

    def cached_prefix(self, prompt: list[int]) -> BlockTable:
        """The longest cached prefix usable exactly (module docstring): a table of the blocks that
        hold it in every kind (not yet referenced), ``NO_BLOCK`` where a sliding kind needs none."""
        full, size = self.pool.cached_prefix(prompt), self.block_size
        hashes = self.pool.chain(prompt, len(full))
        for m in range(len(full), 0, -1):  # the longest hit first
            windows = {}
            for w, pool in self.window_pools.items():
                first = first_visible_block(w, m * size, size)
                blocks = [pool.lookup(hashes[i], prompt[i * size : (i + 1) * size]) for i in range(first, m)]
                if None in blocks:
                    break
                windows[w] = [NO_BLOCK] * first + blocks
            else:
                return BlockTable(full[:m], windows)
        return BlockTable([], {w: [] for w in self.window_pools})

    def can_allocate(self, prompt: list[int], total_tokens: int, chunk: int | None = None) -> bool:
        shared = self.cached_prefix(prompt)
        if self.pool.blocks_for(total_tokens) - len(shared) + self.pool.revived(shared) > self.pool.num_free:
            return False
        chunk = total_tokens if chunk is None else chunk
        return all(pool.reserved + self.reservation(w, total_tokens, chunk) <= pool.num_blocks
                   for w, pool in self.window_pools.items())

    def allocate(self, prompt: list[int], total_tokens: int, chunk: int | None = None) -> tuple[BlockTable, int]:
        """Blocks for a request of ``total_tokens`` (prompt + every new token) running at most
        ``chunk`` tokens a step -> (its table, number of prompt tokens already in the cache). The
        full kind's blocks are taken now, the sliding kinds' reserved. The caller checked
        ``can_allocate``."""
        table = self.cached_prefix(prompt)
        cached = len(table) * self.block_size
        self.pool.revive(table)
        table += self.pool.take(self.pool.blocks_for(total_tokens) - len(table))
        chunk = total_tokens if chunk is None else chunk
        for w, pool in self.window_pools.items():
            pool.revive(table.windows[w])
            table.reserved[w] = self.reservation(w, total_tokens, chunk)
            pool.reserved += table.reserved[w]
        return table, cached

    def grow(self, table: BlockTable, total_tokens: int, chunk: int | None = None) -> bool:
        """A kept sequence goes on to ``total_tokens`` (a chat session's next turn): more full
        blocks, new reservations -> False, changing nothing, when there is no room."""
        chunk = total_tokens if chunk is None else chunk
        wanted = {w: self.reservation(w, total_tokens, chunk) for w in self.window_pools}
        if any(pool.reserved - table.reserved.get(w, 0) + wanted[w] > pool.num_blocks
               for w, pool in self.window_pools.items()):
            return False
        if not self.pool.grow(table, total_tokens):
            return False
        for w, pool in self.window_pools.items():
            pool.reserved += wanted[w] - table.reserved.get(w, 0)
            table.reserved[w] = wanted[w]
        return True

    def take(self, num_tokens: int) -> BlockTable:
        """A new sequence's table with fresh blocks in every kind for ``num_tokens`` (no reservation:
        for a caller that sized the pools itself, as beam search does)."""
        blocks = self.pool.blocks_for(num_tokens)
        return BlockTable(self.pool.take(blocks), {w: pool.take(blocks) for w, pool in self.window_pools.items()})

    def scratch_table(self) -> BlockTable:
        """One block of every kind, never freed (reserved in the sliding kinds): where the fixed-shape
        decode step's padding rows write (engine/compiled.py)."""
        table = self.take(1)
        for w, pool in self.window_pools.items():
            table.reserved[w] = 1
            pool.reserved += 1
        return table

    def publish(self, table: BlockTable, tokens: list[int], hashes: list[int], end_block: int) -> None:
        """Blocks up to ``end_block`` hold computed K/V: name them in every kind (``BlockPool.publish``)."""
        done = len(hashes)
        self.pool.publish(table, tokens, hashes, end_block)
        size = self.block_size
        for w, pool in self.window_pools.items():
            blocks = table.windows[w]
            for i in range(done, min(end_block, len(blocks))):
                pool.name(blocks[i], hashes[i], tuple(tokens[i * size : (i + 1) * size]))

    def release(self, table: list[int]) -> None:
        """The sequence is done with its blocks and its reservations (``seq_rm`` of all its slots)."""
        self.pool.release(table)
        for w, pool in self.window_pools.items():
            pool.release(sliding_blocks(table).get(w, []))
            pool.reserved -= getattr(table, "reserved", {}).get(w, 0)

    def slide(self, table: BlockTable, start: int) -> None:
        """The sequence's next queries are at positions >= ``start``: each sliding kind hands back
        the blocks no such query can see (they keep their prefix names until reused)."""
        for w, pool in self.window_pools.items():
            blocks = table.windows[w]
            first = min(first_visible_block(w, start, self.block_size), len(blocks))
            pool.release(blocks[:first])
            blocks[:first] = [NO_BLOCK] * first

    def prepare(self, table: BlockTable, start: int, end: int) -> BlockTable:
        """Tokens [start, end) are about to run: ``slide`` to ``start``, then ``writable``."""
        self.slide(table, start)
        return self.writable(table, start, end)

    # -- per-sequence verbs (llama.cpp's seq_*), on every kind. Token p of a sequence sits at
    # -- position p, in logical block p // block. Tables are host lists.
    def writable(self, table: BlockTable, start: int, end: int) -> BlockTable:
        """Make tokens [start, end) of a sequence writable in place in every kind (modifies and
        returns ``table``): blocks past its end, or slid out, come from the pool, and a block shared
        with another sequence is copied first (copy-on-write, as vLLM does for the partially filled
        last block of forked beams)."""
        size = self.block_size
        last = self.pool.blocks_for(end)
        table += self.pool.take(max(0, last - len(table)))
        self._copy_shared(None, table, start // size, last)
        if self.window_pools and not isinstance(table, BlockTable):
            raise TypeError("a cache with sliding-window layers needs BlockTables (SlotCache.take / allocate)")
        for w, pool in self.window_pools.items():
            blocks = table.windows.setdefault(w, [])
            blocks += [NO_BLOCK] * max(0, last - len(blocks))
            for index in range(start // size, last):
                if blocks[index] == NO_BLOCK:
                    (blocks[index],) = pool.take(1)
            self._copy_shared(w, blocks, start // size, last)
        return table

    def _copy_shared(self, window: int | None, blocks: list[int], first: int, last: int) -> None:
        """Copy-on-write of the shared blocks among ``blocks[first:last]`` of kind ``window``."""
        pool, size = self.pool_of(window), self.block_size
        keys, values = (self.keys, self.values) if window is None else (self.window_keys[window],
                                                                        self.window_values[window])
        for index in range(first, last):
            if pool.ref_counts[blocks[index]] > 1:
                (copy,) = pool.take(1)
                keys[:, copy * size : (copy + 1) * size] = keys[:, blocks[index] * size : (blocks[index] + 1) * size]
                values[:, copy * size : (copy + 1) * size] = values[:, blocks[index] * size : (blocks[index] + 1) * size]
                pool.release([blocks[index]])
                blocks[index] = copy

    def seq_cp(self, table: BlockTable) -> BlockTable:
        """A new sequence holding the same tokens: every block shared by reference in every kind, no
        K/V copied (the first write into a shared block copies that one block: ``writable``)."""
        return BlockTable(self.pool.share(table),
                          {w: self.window_pools[w].share(blocks) for w, blocks in sliding_blocks(table).items()})

    def seq_rm(self, table: BlockTable, p0: int) -> BlockTable:
        """Remove the tokens [p0, end) -> the kept table (blocks wholly past p0 lose this reference)."""
        keep = self.pool.blocks_for(p0)
        self.pool.release(table[keep:])
        windows = {}
        for w, blocks in sliding_blocks(table).items():
            self.window_pools[w].release(blocks[keep:])
            windows[w] = blocks[:keep]
        return BlockTable(table[:keep], windows, getattr(table, "reserved", None))

    def seq_keep(self, tables: list[BlockTable], sources: list[int]) -> list[BlockTable]:
        """Sequence i becomes a copy of sequence ``sources[i]`` (a beam reorder; a sequence no one
        names is dropped): tables are shared by reference, no K/V moves, the old tables are released
        (with their reservations: each copy carries its source's)."""
        kept = []
        for source in sources:
            copy = self.seq_cp(tables[source])
            copy.reserved = dict(getattr(tables[source], "reserved", {}))
            for w, count in copy.reserved.items():
                self.window_pools[w].reserved += count
            kept.append(copy)
        for table in tables:
            self.release(table)
        return kept

    def seq_add(self, table: BlockTable, p0: int, p1: int, delta: int,
                rotate: Callable[[int, torch.Tensor, int], torch.Tensor] | None = None) -> BlockTable:
        """Add ``delta`` to the positions of tokens [p0, p1) -> the table.

        Here a token's position is its index in its sequence, so a token whose position changes
        moves to the slot of its new position: K/V of [p0, p1) are copied to [p0 + delta, p1 + delta)
        (what was there, removed or never used, is overwritten) and each key is re-rotated by
        ``delta`` with ``rotate(layer, keys [1, Hkv, N, D], delta)`` (RoPE: llama.cpp's K-shift;
        None for ALiBi, whose bias is rebuilt from positions like every mask). In a sliding kind
        only the tokens it still holds move. Llama.cpp's context shift is
        ``seq_add(t, n_keep + n_discard, n, -n_discard)`` then ``seq_rm(t, n - n_discard)``."""
        if p0 + delta < 0:
            raise ValueError(f"seq_add would move token {p0} to position {p0 + delta}")
        held = {w: [p for p in range(p0, p1) if len(blocks) > p // self.block_size
                    and blocks[p // self.block_size] != NO_BLOCK] for w, blocks in sliding_blocks(table).items()}
        table = self.writable(table, p0 + delta, p1 + delta)
        device = self.keys.device
        for window in [None, *sliding_blocks(table)]:
            moving = range(p0, p1) if window is None else held[window]
            source = torch.tensor([s for p in moving for s in self.slot_ids(table, p, p + 1, window)],
                                  dtype=torch.long, device=device)  # [N]
            target = torch.tensor([s for p in moving for s in self.slot_ids(table, p + delta, p + delta + 1, window)],
                                  dtype=torch.long, device=device)
            for layer in [i for i, w in enumerate(self.layer_windows) if w == window]:
                keys, values = self.layer_keys[layer], self.layer_values[layer]
                moved = keys.index_select(0, source)  # [N, Hkv, D] (a copy: the ranges may overlap)
                if rotate is not None:
                    moved = rotate(layer, moved.transpose(0, 1)[None], delta)[0].transpose(0, 1)  # via [1, Hkv, N, D]
                keys.index_copy_(0, target, moved)
                values.index_copy_(0, target, values.index_select(0, source))
        return table


def check_fits(needed_tokens: int, cache: SlotCache, what: str, chunk: int | None = None) -> None:
    """A request that could never fit the whole pool (of any kind) is refused before it waits for room."""
    if cache.pool.blocks_for(needed_tokens) > cache.pool.num_blocks:
        raise PromptTooLongError(
            f"{what} needs {needed_tokens} cache slots (prompt + max_new_tokens) but the engine's cache "
            f"holds {cache.capacity_tokens}: lower max_new_tokens or give the engine more cache_tokens"
        )
    chunk = needed_tokens if chunk is None else chunk
    for w, pool in cache.window_pools.items():
        if cache.reservation(w, needed_tokens, chunk) > pool.num_blocks:
            raise PromptTooLongError(
                f"{what} needs {cache.reservation(w, needed_tokens, chunk)} blocks of the sliding-window "
                f"(window {w}) cache at once but it holds {pool.num_blocks}: give the engine more cache_tokens"
            )
