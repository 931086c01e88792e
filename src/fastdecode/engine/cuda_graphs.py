"""Pure-decode engine steps replayed from CUDA graphs, one graph per (row bucket, block bucket).

A decode step of a small batch on a GPU is bound by kernel launches, not by the weights it reads:
a 1B model's step is ~250 kernels of a few microseconds each. ``decode_step`` (engine/decode_step.py)
has fixed shapes for a given (rows, table width) and asks the host for nothing, so the whole step
is captured once into a ``torch.cuda.CUDAGraph`` and later steps only copy their inputs (tokens,
positions, block tables) into the graph's static buffers and replay it, as vLLM and gpt-fast do.

Buckets: rows are padded to a power of two (padding rows decode token 0 at position 0 into a
scratch block), and the block tables to a power of two of blocks (at least ``MIN_BLOCKS``; the
position mask hides every slot past a row's own position), so a sequence growing past a bucket
captures one more graph, and a handful of graphs serve every batch size and context length.
Every graph draws its intermediate tensors from one shared memory pool (graphs replay one at a
time, on the engine's thread). The first use of a bucket runs the step eagerly on a side stream
(warm-up: lazy per-device constants, cuBLAS workspaces) before capturing it; that run writes the
same K/V the replay writes again, so it changes nothing.

The default for an engine whose model lives on a CUDA device (decoder-only models); the eager
varlen forward keeps prompt chunks and mixed steps. With ``compile_decode`` the captured step is
the inductor-compiled one (its element-wise ops fused: fewer, larger kernels per layer), compiled
once per bucket at its warm-up.
"""

from __future__ import annotations

import functools
import gc
from dataclasses import dataclass
from typing import Any

import torch

from .compiled import RECOMPILE_LIMIT, bucket
from .decode_step import decode_products, decode_step, decode_window_tables

# Block buckets start at 16 blocks (256 tokens at 16 per block): a short generation captures one
# graph, and attending over a few hundred masked slots costs a GPU next to nothing.
MIN_BLOCKS = 16


@dataclass
class _Captured:
    """One captured step and the static tensors it reads and writes."""
    graph: Any  # torch.cuda.CUDAGraph
    table: torch.Tensor  # [rows, blocks] block ids
    tokens: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows]
    windowed: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per sliding kind: tables [rows, m], starts [rows, 1]
    logits: torch.Tensor  # [rows, V], written by each replay


class CapturedDecode:
    """``logits(sequences)`` for a step where every sequence decodes its last token (the interface of
    engine/compiled.py's ``CompiledDecode``), from CUDA graphs."""

    def __init__(self, engine: Any, compile_step: bool = False):
        self.cache = engine.cache
        self.scratch_table = self.cache.scratch_table()  # the padding rows' blocks, never freed
        self.scratch = self.scratch_table[0]
        self.step = functools.partial(decode_step, engine.model, engine.cache, engine.windows, engine.score_bias,
                                 decode_products(engine.model))
        self.compiled_step = compile_step
        if compile_step:
            self.step = torch.compile(self.step, fullgraph=True, dynamic=False)
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0  # steps served from a graph (tests, stats)

    def table_width(self, sequences: list) -> int:
        """The block bucket of a step: a power of two of blocks covering every row's tokens."""
        needed = max((s.num_tokens - 1) // self.cache.block_size + 1 for s in sequences)
        return bucket(max(MIN_BLOCKS, needed))

    def inputs(self, sequences: list, rows: int, blocks: int) -> tuple[torch.Tensor, ...]:
        """The step's inputs on the host side of the copy: table [rows, blocks], tokens [rows],
        positions [rows], and each sliding kind's (tables, starts); padding rows use the scratch block."""
        pad = rows - len(sequences)
        tables = [s.block_table[:blocks] for s in sequences] + [[]] * pad
        table = torch.tensor([t + [self.scratch] * (blocks - len(t)) for t in tables])  # [rows, blocks]
        tokens = torch.tensor([s.tokens(s.num_tokens - 1, s.num_tokens)[0] for s in sequences] + [0] * pad)  # [rows]
        last = [s.num_tokens - 1 for s in sequences] + [0] * pad
        windowed = decode_window_tables(self.cache, [s.block_table for s in sequences] + [self.scratch_table] * pad,
                                        last, device=torch.device("cpu"))
        return table, tokens, torch.tensor(last), windowed

    def logits(self, sequences: list) -> torch.Tensor:
        """One decode token for each sequence (its last token, not yet computed) -> logits [B, V]
        (a view of the graph's output: read it before the next step)."""
        rows, blocks = bucket(len(sequences)), self.table_width(sequences)
        table, tokens, positions, windowed = self.inputs(sequences, rows, blocks)
        captured = self.graphs.get((rows, blocks))
        if captured is None:
            captured = self.graphs[rows, blocks] = self._capture(table, tokens, positions, windowed)
        else:
            captured.table.copy_(table, non_blocking=True)
            captured.tokens.copy_(tokens, non_blocking=True)
            captured.positions.copy_(positions, non_blocking=True)
            for (static_table, static_start), (kind_table, kind_start) in zip(captured.windowed, windowed):
                static_table.copy_(kind_table, non_blocking=True)
                static_start.copy_(kind_start, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return captured.logits[: len(sequences)]

    def _capture(self, table, tokens, positions, windowed) -> _Captured:
        device = self.cache.keys.device
        static = (table.to(device), tokens.to(device), positions.to(device),
                  tuple((t.to(device), s.to(device)) for t, s in windowed))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        # one compiled graph per bucket of the one step function: more than dynamo's default 8
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            with torch.cuda.stream(side):  # warm-up (and compilation): lazy constants, library workspaces
                for _ in range(2 if self.compiled_step else 1):  # a lazy constant made by the first call
                    self.step(*static)  # changes what dynamo guards on: the second call recompiles, not the capture
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # No garbage collection inside the capture: an unreachable engine's graph destroyed by a
            # collection there is a CUDA call the capture forbids, and invalidates it (seen on an H200
            # in the parity suite: "operation not permitted when stream is capturing (function reset)").
            gc.collect()
            collecting = gc.isenabled()
            gc.disable()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    logits, _ = self.step(*static)
            finally:
                if collecting:
                    gc.enable()
        return _Captured(graph, *static, logits)
