"""The slot cache: K/V storage in fixed-size blocks owned by sequences, with a prefix cache.

Every layer keeps one K and one V buffer ``[num_blocks * block_size, Hkv, D]`` (a flat array
of slots, token-major, only the KV heads the model has). A sequence owns a *block table*: the
block ids holding its tokens 0, 1, 2, ... in order, so token ``p`` of a sequence lives in slot
``table[p // block_size] * block_size + p % block_size`` and its position is ``p``. Nothing is
left-padded: a sequence attends to its own slots only, whatever else is in the pool.

Prefix cache (as nano-vllm's block manager): a *full* block is named by a hash chain over token
ids, ``h_i = hash(h_{i-1}, tokens of block i)``. A new sequence whose first blocks carry the same
tokens as blocks already computed shares them (reference counts) and only runs the model on the
rest. A block whose last owner left goes back to the free list but keeps its hash until it is
reused (least recently freed first), so a later request can still revive it. Reuse is by token
ids, never by text; a hit is confirmed by comparing the ids, not by trusting the hash.

Verbs, in the spirit of llama.cpp's ``seq_*`` (a sequence's slots are [0, length)):
``allocate`` (reserve blocks, sharing a cached prefix: a ``seq_cp`` without a copy), ``release``
(``seq_rm`` of everything), ``grow`` (more blocks for a kept sequence that goes on) and ``publish``
(name newly filled full blocks so others can share them).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..errors import PromptTooLongError

BLOCK_SIZE = 16


class BlockPool:
    """Block bookkeeping (host side): free list, reference counts, the prefix hash chain."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks in the order they were freed (oldest first: evicted first). A free block may
        # still carry a hash (a cached prefix that can be revived).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, its token ids)
        self.by_hash: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain(self, tokens: list[int], num_blocks: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks of ``tokens`` (each covers all before it)."""
        hashes, previous, size = [], 0, self.block_size
        for i in range(num_blocks):
            previous = hash((previous, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(previous)
        return hashes

    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of ``prompt`` (full blocks only, and
        never the whole prompt: its last token must run to give the first logits)."""
        usable = (len(prompt) - 1) // self.block_size
        blocks = []
        for i, h in enumerate(self.chain(prompt, usable)):
            block = self.by_hash.get(h)
            size = self.block_size
            if block is None or self.block_key[block][1] != tuple(prompt[i * size : (i + 1) * size]):
                break
            blocks.append(block)
        return blocks

    def can_allocate(self, prompt: list[int], total_tokens: int) -> bool:
        shared = self.cached_prefix(prompt)
        revived = sum(1 for b in shared if self.ref_counts[b] == 0)
        return self.blocks_for(total_tokens) - len(shared) + revived <= self.num_free

    def allocate(self, prompt: list[int], total_tokens: int) -> tuple[list[int], int]:
        """Reserve blocks for ``total_tokens`` (prompt + every new token) -> (block table, number of
        prompt tokens already in the cache). The caller checked ``can_allocate``."""
        shared = self.cached_prefix(prompt)
        table = list(shared)
        for block in shared:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        for _ in range(self.blocks_for(total_tokens) - len(table)):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            table.append(block)
        return table, len(shared) * self.block_size

    def grow(self, table: list[int], total_tokens: int) -> bool:
        """Append fresh blocks to a kept sequence's table (a chat session's next turn) until it holds
        ``total_tokens`` -> False, changing nothing, when too few blocks are free."""
        missing = self.blocks_for(total_tokens) - len(table)
        if missing > self.num_free:
            return False
        for _ in range(missing):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            table.append(block)
        return True

    def publish(self, table: list[int], tokens: list[int], hashes: list[int], end_block: int) -> None:
        """A sequence's blocks up to ``end_block`` now hold computed K/V: extend its hash chain
        ``hashes`` and name the blocks, so later requests with the same tokens can share them."""
        size = self.block_size
        previous = hashes[-1] if hashes else 0
        for i in range(len(hashes), end_block):
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            previous = hash((previous, block_tokens))
            hashes.append(previous)
            if table[i] not in self.block_key:  # a block shared from the cache is named already
                self.block_key[table[i]] = (previous, block_tokens)
                self.by_hash[previous] = table[i]

    def release(self, table: list[int]) -> None:
        """The sequence is done with its blocks (``seq_rm`` of all its slots)."""
        for block in table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None

    def _forget(self, block: int) -> None:
        key = self.block_key.pop(block, None)
        if key is not None and self.by_hash.get(key[0]) == block:
            del self.by_hash[key[0]]


class SlotCache:
    """The K/V buffers behind a ``BlockPool``: per layer ``[num_blocks * block_size, Hkv, D]``."""

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int = BLOCK_SIZE):
        self.pool = BlockPool(num_blocks, block_size)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        # Zeros, not empty: a masked slot still meets a zero probability, and 0 * NaN would be NaN.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # [L, slots, Hkv, D]
        self.layer_keys, self.layer_values = list(self.keys.unbind(0)), list(self.values.unbind(0))

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def slot_ids(self, table: list[int], start: int, end: int) -> list[int]:
        """Slots of a sequence's tokens [start, end) (host list)."""
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def block_tables(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` blocks of each sequence's table -> [B, num_blocks] (past the end
        of a shorter table: block 0, whose slots the position mask hides)."""
        rows = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
        return torch.tensor(rows, dtype=torch.long, device=self.keys.device)

    def gather(self, layer_buffer: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """A layer's K or V [slots, Hkv, D] read through block tables [B, n] -> [B, Hkv, n * block, D]
        (key j of a row is its position j). Whole blocks are copied with ``index_select``: many
        times faster on CPU than indexing slot by slot."""
        B, n = block_table.shape
        _, Hkv, D = layer_buffer.shape
        blocks = layer_buffer.view(-1, self.block_size, Hkv, D)  # [num_blocks, block, Hkv, D]
        rows = blocks.index_select(0, block_table.flatten())  # [B*n, block, Hkv, D]
        return rows.view(B, n * self.block_size, Hkv, D).transpose(1, 2)  # [B, S, Hkv, D] -> [B, Hkv, S, D]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


def check_fits(needed_tokens: int, cache: SlotCache, what: str) -> None:
    """A request that could never fit the whole pool is refused before it waits for room."""
    if cache.pool.blocks_for(needed_tokens) > cache.pool.num_blocks:
        raise PromptTooLongError(
            f"{what} needs {needed_tokens} cache slots (prompt + max_new_tokens) but the engine's cache "
            f"holds {cache.capacity_tokens}: lower max_new_tokens or give the engine more cache_tokens"
        )
