"""Pure-decode engine steps through the fixed-shape decode step, compiled once per row bucket.

When every row of a step decodes one token, the engine can run ``decode_step`` instead of the
varlen ``StepPlan`` forward: rows are padded to a power-of-two bucket, and the number of blocks in
the rows' tables is a dynamic dimension (``mark_dynamic``), so ``torch.compile(fullgraph=True)``
traces one graph per row bucket that serves every context length. (With the blocks static too, a
sequence growing into a new block bucket recompiled the step: minutes of inductor per bucket on
this CPU, which made a 64-token decode look like 0.2 tokens/s.) Padding rows decode token 0 at
position 0 into a scratch block the engine sets aside; the position mask hides every slot past a
row's own position, so neither padding rows nor padding blocks change a real row's logits.

Opt-in (``Generator.engine(compile_decode=True)``): compiling costs tens of seconds per bucket on a
CPU, worth it only for a long-lived engine (a server) where Python overhead per op dominates a
small batch's step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .decode_step import decode_products, decode_step, decode_window_tables


# Graphs of the one code object torch.compile wraps every engine's step in: row buckets (1 .. 64
# rows) of each engine in the process, and each new model traced again.
RECOMPILE_LIMIT = 64
# Block tables have at least two blocks (padded with the scratch block): dynamo specializes a
# dimension of size 1, so starting at 2 keeps every length in the one dynamic graph.
MIN_BLOCKS = 2


def bucket(count: int) -> int:
    """The smallest power of two >= count."""
    return 1 << max(0, count - 1).bit_length()


class CompiledDecode:
    def __init__(self, engine: Any, backend: Any = "inductor"):
        self.cache = engine.cache
        self.scratch_table = self.cache.scratch_table()  # the padding rows' blocks, never freed
        self.scratch = self.scratch_table[0]
        step = functools.partial(decode_step, engine.model, engine.cache, engine.windows, engine.score_bias,
                                 decode_products(engine.model))
        self.step = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)

    def logits(self, sequences: list) -> torch.Tensor:
        """One decode token for each sequence (its last token, not yet computed) -> logits [B, V]."""
        device = self.cache.keys.device
        size = self.cache.block_size
        rows = bucket(len(sequences))
        blocks = max(MIN_BLOCKS, max((s.num_tokens - 1) // size + 1 for s in sequences))
        tables = [s.block_table[:blocks] for s in sequences] + [[]] * (rows - len(sequences))
        table = torch.tensor([t + [self.scratch] * (blocks - len(t)) for t in tables], device=device)  # [rows, blocks]
        pad = rows - len(sequences)
        tokens = torch.tensor([s.tokens(s.num_tokens - 1, s.num_tokens)[0] for s in sequences] + [0] * pad,
                              device=device)  # [rows]
        last = [s.num_tokens - 1 for s in sequences] + [0] * pad
        positions = torch.tensor(last, device=device)  # [rows]
        # Sliding kinds: padding rows read and write their kind's scratch block (fixed-width tables).
        padding = self.scratch_table
        windowed = decode_window_tables(self.cache, [s.block_table for s in sequences] + [padding] * pad,
                                        last)
        # The number of blocks is a dynamic dimension: one graph serves a row bucket at every length
        # (a static one recompiled each time a sequence grew into a new block bucket: minutes each).
        torch._dynamo.mark_dynamic(table, 1, min=MIN_BLOCKS, max=max(MIN_BLOCKS + 1, self.cache.pool.num_blocks))
        # Each row bucket is its own graph (per engine): more than dynamo's default 8 per function.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            logits, _ = self.step(table, tokens, positions, windowed)
        return logits[: len(sequences)]
