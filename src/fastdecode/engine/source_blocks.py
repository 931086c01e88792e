"""The cross store's K/V buffers: encoder-decoder sources in blocks, each head's rows contiguous.

A source's cross K/V are written once, when its sequence is admitted, and then only read, by every
decoder step of every beam of its group, so their layout follows the read: per decoder layer
``[blocks, H, block, D]`` for keys and for values (block b holds the source tokens
``b * block .. (b + 1) * block - 1`` of whichever source owns it; within a block, each head's
``block`` keys are consecutive). A query then streams a head's keys a block at a time
(layers/cross_attention.cpp ``paged_cross_attention``, as its contiguous ``cross_attention`` reads a
source ``[H, S, D]``), where the decoder's own slot cache ``[slots, Hkv, D]`` would put every key of a
head ``H * D`` floats from the next. The blocks come from a ``BlockPool`` (engine/blocks.py): no
prefix sharing (a source is never shared between requests), released when the sequence ends.
"""

from __future__ import annotations

import torch

from .blocks import BlockPool, PooledBuffers
from .lazy_zeros import zeroed


class SourceBlocks(PooledBuffers):
    """``layer_keys[i]`` / ``layer_values[i]``: decoder layer i's ``[blocks, H, block, D]`` buffers."""

    def __init__(self, num_layers: int, num_blocks: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int):
        self.pool = BlockPool(num_blocks, block_size)
        shape = (num_blocks, num_heads, block_size, head_dim)
        # Zeros, not empty: a key past a source's end is never read, but 0 * NaN would be NaN if it were.
        # One buffer per layer, not one for all: an engine made per call (generate_ids) then gets its
        # buffers back from the allocator's heap at the next call (glibc serves blocks below its
        # adaptive mmap threshold, at most 32 MB, from the heap), not as fresh pages that each fault
        # once when the sources are written (bart-base, 8 x 256 tokens: 75 MB, ~0.25 s of a call).
        self.layer_keys = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.layer_values = [zeroed(shape, dtype, device) for _ in range(num_layers)]
        self.device = device

    @property
    def block_nbytes(self) -> int:
        """K and V bytes of one block in every layer."""
        return 2 * sum(keys[0].nbytes for keys in self.layer_keys)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.layer_keys, self.layer_values))

    def write(self, layer: int, tables: list[list[int]], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store B right-padded sources' K and V [B, H, S, D] of decoder ``layer`` (any strides: the cross
        projection's views go straight into the blocks, one copy): row b's first ``len(tables[b])`` blocks
        of tokens in its blocks ``tables[b]``. A last block's rows past the batch's S keep what they held
        (zeros or an earlier source's K/V: finite, never read: attention stops at the source's length, or
        masks them); rows past a shorter source's length hold its padding's K/V."""
        size, S = self.block_size, keys.shape[2]
        full = S // size  # blocks wholly inside the S tokens
        # each source's whole blocks by runs of consecutive block ids (a fresh pool hands them out so): one
        # strided copy_ per run, 2.4x faster than index_copy_ from the strided views (bart-base, 8 x 256)
        runs = [(b, run) for b, table in enumerate(tables) for run in consecutive_runs(table[:full])]
        partial = [b for b, t in enumerate(tables) if len(t) > full]  # a last block with S - full * size rows
        for source, buffer in ((keys, self.layer_keys[layer]), (values, self.layer_values[layer])):
            source = source.to(buffer.dtype)
            blocks = source[:, :, : full * size].unflatten(2, (full, size)).transpose(1, 2)  # [B, full, H, block, D]
            for b, (start, first, count) in runs:
                buffer[start : start + count].copy_(blocks[b, first : first + count])  # [count, H, block, D]
            if partial:
                last = torch.tensor([tables[b][full] for b in partial], dtype=torch.long, device=keys.device)  # [R]
                rows = torch.tensor(partial, dtype=torch.long, device=keys.device)  # [R]
                buffer[last, :, : S - full * size] = source[rows, :, full * size :]  # [R, H, S - full * block, D]

    def read(self, layer: int, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One source's K and V [H, L, D] of decoder ``layer`` (a copy)."""
        blocks = torch.tensor(table, dtype=torch.long, device=self.device)  # [n]
        return tuple(buffer.index_select(0, blocks).transpose(0, 1).flatten(1, 2)[:, :length]  # [H, n * block, D]
                     for buffer in (self.layer_keys[layer], self.layer_values[layer]))

    def gather(self, buffer: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """A layer's K or V [blocks, H, block, D] read through block tables [B, n] -> [B, H, n * block, D]."""
        B, n = table.shape
        rows = buffer.index_select(0, table.flatten())  # [B * n, H, block, D]
        return rows.unflatten(0, (B, n)).transpose(1, 2).flatten(2, 3)  # [B, n, H, block, D] -> [B, H, n * block, D]


def consecutive_runs(table: list[int]) -> list[tuple[int, int, int]]:
    """(first block id, its index in ``table``, count) of each run of consecutive ascending block ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(table):
        if runs and block == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block, i, 1))
    return runs
