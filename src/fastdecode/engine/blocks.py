"""Block bookkeeping of the slot cache (engine/slots.py): one ``BlockPool`` per attention kind
(free list, reference counts, the prefix hash chain, reservations) and a sequence's ``BlockTable``
(its blocks in every kind)."""

from __future__ import annotations

from collections import OrderedDict

import torch

BLOCK_SIZE = 16
NO_BLOCK = -1  # a sliding kind's entry for a logical block it does not hold (slid out of the window)


class BlockPool:
    """Block bookkeeping of one kind (host side): free list, reference counts, the prefix hash
    chain, and ``reserved``: blocks promised to admitted sequences (sliding kinds only)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        # Free blocks: unnamed ones first (most recently freed first), then named ones in the order
        # they were freed (oldest first: evicted first). A named free block still carries its hash (a
        # cached prefix that can be revived).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.block_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, its token ids)
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.reserved = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def chain(self, tokens: list[int], num_blocks: int) -> list[int]:
        """Hashes of the first ``num_blocks`` full blocks of ``tokens`` (each covers all before it)."""
        hashes, previous, size = [], 0, self.block_size
        for i in range(num_blocks):
            previous = hash((previous, tuple(tokens[i * size : (i + 1) * size])))
            hashes.append(previous)
        return hashes

    def lookup(self, block_hash: int, block_tokens: list[int]) -> int | None:
        """The block named ``block_hash`` if it holds exactly ``block_tokens`` (ids compared, not trusted)."""
        block = self.by_hash.get(block_hash)
        if block is None or self.block_key[block][1] != tuple(block_tokens):
            return None
        return block

    def cached_prefix(self, prompt: list[int]) -> list[int]:
        """Blocks already holding the longest cached prefix of ``prompt`` (full blocks only, and
        never the whole prompt: its last token must run to give the first logits)."""
        usable, size = (len(prompt) - 1) // self.block_size, self.block_size
        blocks = []
        for i, h in enumerate(self.chain(prompt, usable)):
            block = self.lookup(h, prompt[i * size : (i + 1) * size])
            if block is None:
                break
            blocks.append(block)
        return blocks

    def revive(self, blocks: list[int]) -> None:
        """One more reference to each of ``blocks`` (named blocks found by the prefix cache)."""
        for block in blocks:
            if block != NO_BLOCK:
                if self.ref_counts[block] == 0:
                    del self.free[block]
                self.ref_counts[block] += 1

    def revived(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit on the free list (sharing them takes free blocks)."""
        return sum(1 for b in blocks if b != NO_BLOCK and self.ref_counts[b] == 0)

    def can_allocate(self, prompt: list[int], total_tokens: int) -> bool:
        shared = self.cached_prefix(prompt)
        return self.blocks_for(total_tokens) - len(shared) + self.revived(shared) <= self.num_free

    def allocate(self, prompt: list[int], total_tokens: int) -> tuple[list[int], int]:
        """Reserve blocks for ``total_tokens`` (prompt + every new token) -> (block table, number of
        prompt tokens already in the cache). The caller checked ``can_allocate``."""
        shared = self.cached_prefix(prompt)
        self.revive(shared)
        return shared + self.take(self.blocks_for(total_tokens) - len(shared)), len(shared) * self.block_size

    def grow(self, table: list[int], total_tokens: int) -> bool:
        """Append fresh blocks to a kept sequence's table (a chat session's next turn) until it holds
        ``total_tokens`` -> False, changing nothing, when too few blocks are free."""
        missing = self.blocks_for(total_tokens) - len(table)
        if missing > self.num_free:
            return False
        table += self.take(max(0, missing))
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
            self.name(table[i], previous, block_tokens)

    def name(self, block: int, block_hash: int, block_tokens: tuple[int, ...]) -> None:
        if block != NO_BLOCK and block not in self.block_key:  # a block shared from the cache is named already
            self.block_key[block] = (block_hash, block_tokens)
            self.by_hash[block_hash] = block

    def take(self, count: int) -> list[int]:
        """``count`` fresh blocks (unnamed first, then the least recently freed; their prefix names are
        forgotten)."""
        if count > self.num_free:
            raise RuntimeError(f"block pool exhausted: {count} blocks wanted, {self.num_free} free")
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            self._forget(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def share(self, table: list[int]) -> list[int]:
        """Another reference to every block of ``table`` -> a table of the same blocks."""
        for block in table:
            if block != NO_BLOCK:
                self.ref_counts[block] += 1
        return list(table)

    def release(self, table: list[int]) -> None:
        """The sequence is done with its blocks (``seq_rm`` of all its slots). A named block joins the
        end of the free list (a cached prefix, evicted last); a block without a name, which nothing can
        revive, joins its front and is the next taken: its memory is warm, where a block never used
        yet costs a page fault on first touch (the cache's memory is zeroed lazily: lazy_zeros.py),
        so the resident memory stays at what is in use at once (a Whisper beam-5 search on the
        tiny.en model touched 160 MB of cache, every copy-on-write taking an untouched block)."""
        for block in table:
            if block != NO_BLOCK:
                self.ref_counts[block] -= 1
                if self.ref_counts[block] == 0:
                    self.free[block] = None
                    if block not in self.block_key:
                        self.free.move_to_end(block, last=False)

    def unname(self, table: list[int]) -> None:
        """Forget the names of the blocks of ``table`` no other sequence holds."""
        for block in table:
            if block != NO_BLOCK and self.ref_counts[block] == 1:
                self._forget(block)

    def _forget(self, block: int) -> None:
        key = self.block_key.pop(block, None)
        if key is not None and self.by_hash.get(key[0]) == block:
            del self.by_hash[key[0]]


class PooledBuffers:
    """What K/V buffers behind one ``BlockPool`` (``self.pool``) on ``self.device`` say of their geometry,
    and their block tables as tensors."""

    pool: BlockPool
    device: torch.device

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.pool.block_size

    def block_tables(self, tables: list[list[int]], num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` blocks of each table -> [B, num_blocks] (past the end of a shorter
        table: block 0, which its reader never reads: a position mask or a source's length stops it)."""
        rows = [t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in tables]
        return torch.tensor(rows, dtype=torch.long, device=self.device)


class BlockTable(list):
    """A sequence's blocks. The list itself: the full-attention kind's block of each logical block
    (what a cache without sliding layers calls the table). ``windows[w]``: the block of each
    logical block in the pool of the layers with window ``w`` (``NO_BLOCK`` where it slid out).
    ``reserved[w]``: the blocks of kind ``w`` promised to this sequence at admission."""

    def __init__(self, blocks=(), windows: dict[int, list[int]] | None = None,
                 reserved: dict[int, int] | None = None):
        super().__init__(blocks)
        self.windows = windows if windows is not None else {}
        self.reserved = reserved if reserved is not None else {}


def first_visible_block(window: int, start: int, block_size: int) -> int:
    """The first logical block a sliding layer of ``window`` can read from queries at ``>= start``
    (a query at q sees keys q - window + 1 .. q)."""
    return max(0, start - window + 1) // block_size


def sliding_blocks(table: list[int]) -> dict[int, list[int]]:
    """A table's sliding kinds, window -> blocks (a plain list, as a cache without sliding layers
    takes: none)."""
    return getattr(table, "windows", {})
