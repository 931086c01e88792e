"""Pure-decode engine steps through the fixed-shape decode step, compiled once per bucket.

When every row of a step decodes one token, the engine can run ``decode_step`` instead of the
varlen ``StepPlan`` forward: rows are padded to a power-of-two bucket and each row's block table
to a power-of-two number of blocks, so ``torch.compile(fullgraph=True, dynamic=False)`` (and on a
GPU, CUDA graphs) sees a handful of fixed shapes. Padding rows decode token 0 at position 0 into a
scratch block the engine sets aside; the position mask hides every slot past a row's own
position, so neither padding rows nor padding blocks change a real row's logits.

Opt-in (``Generator.engine(compile_decode=True)``): compiling costs tens of seconds per bucket on a
CPU, worth it only for a long-lived engine (a server) where Python overhead per op dominates a
small batch's step.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .decode_step import decode_step, decode_window_tables


RECOMPILE_LIMIT = 64  # row buckets (1 .. 64) x block buckets (1 .. 512)


def bucket(count: int) -> int:
    """The smallest power of two >= count."""
    return 1 << max(0, count - 1).bit_length()


class CompiledDecode:
    def __init__(self, engine: Any, backend: Any = "inductor"):
        self.cache = engine.cache
        self.scratch_table = self.cache.scratch_table()  # the padding rows' blocks, never freed
        self.scratch = self.scratch_table[0]
        step = functools.partial(decode_step, engine.model, engine.cache, engine.windows, engine.score_bias)
        self.step = torch.compile(step, backend=backend, fullgraph=True, dynamic=False)

    def logits(self, sequences: list) -> torch.Tensor:
        """One decode token for each sequence (its last token, not yet computed) -> logits [B, V]."""
        device = self.cache.keys.device
        size = self.cache.block_size
        rows = bucket(len(sequences))
        blocks = bucket(max((s.num_tokens - 1) // size + 1 for s in sequences))
        tables = [s.block_table[:blocks] for s in sequences] + [[]] * (rows - len(sequences))
        table = torch.tensor([t + [self.scratch] * (blocks - len(t)) for t in tables], device=device)  # [rows, blocks]
        pad = rows - len(sequences)
        tokens = torch.tensor([s.tokens(s.num_tokens - 1, s.num_tokens)[0] for s in sequences] + [0] * pad,
                              device=device)  # [rows]
        last = [s.num_tokens - 1 for s in sequences] + [0] * pad
        positions = torch.tensor(last, device=device)  # [rows]
        # Sliding kinds: padding rows read and write their kind's scratch block.
        padding = self.scratch_table
        windowed = decode_window_tables(self.cache, [s.block_table for s in sequences] + [padding] * pad,
                                        last)
        # Each (rows, blocks) bucket is its own graph: more than dynamo's default 8 per function.
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            logits, _ = self.step(table, tokens, positions, windowed)
        return logits[: len(sequences)]
