"""The model runner: one forward over a step's work -> the logits the sampler needs.

``ModelRunner.run(work)`` makes the rows writable (a sliding kind drops what slid out; beam groups
write within the blocks they hold in reserve), encodes the sources admitted this step (an
encoder-decoder model, engine/cross.py), then picks the forward in this one place:
- a step with streams in it: the mixed plan (engine/stream_steps.py);
- a step where every row decodes its last token, on an engine built with ``compile_decode`` or CUDA
  graphs: the fixed-shape decode step (engine/compiled.py, engine/cuda_graphs.py);
- otherwise one flat varlen forward (``forward_rows``, engine/layout.py).
Each forward's ``Products`` (layers/products.py) carry its rows' roles and the thread budget, which
the runner owns: the caller's torch threads.
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.products import Products
from ..layers.threads import one_thread
from .beam_group import fold_runs, lent_spares
from .cross import CrossStore, row_groups
from .embedding_rows import forward_outputs
from .layout import flat_layout
from .plan import StepPlan
from .scoring import keep_logits
from .sequence import Sequence
from .slots import SlotCache
from .stream_steps import mixed_forward

Work = list[tuple[Sequence, int]]  # (sequence, tokens it runs this step)


class ModelRunner:
    def __init__(self, model: Any, cache: SlotCache, cross: CrossStore | None, windows: list[int | None],
                 score_bias: Any):
        self.model, self.cache, self.cross = model, cache, cross
        self.windows, self.score_bias = windows, score_bias
        self.compiled: Any = None  # the fixed-shape decode step, when the engine asks for one

    @property
    def threads(self) -> int:
        """The thread budget of a forward's big ops: the caller's torch threads."""
        return torch.get_num_threads()

    def run(self, work: Work) -> tuple[torch.Tensor, list[Sequence]]:
        """-> (logits [K, V], the K sequences that reached their last token, in logits order: one row
        each, 1 + its draft's length for a verifying one). Scoring rows are handed to their sequences."""
        # Beam groups write within the blocks they hold in reserve. On one torch thread: a copy-on-write of a shared
        # block is a few small copies, each an OpenMP region of its own on the caller's threads, which waited for a
        # busy second core (bart-base beam 4, 8 x 256 sources, 2 threads at load ~3: 305 copies took 5.1 s of an
        # 11 s call, 0.02-0.05 s on one thread).
        with lent_spares(work), one_thread():
            for sequence, count in work:  # sliding kinds: drop what slid out, take the blocks written now
                if sequence.stream is None:
                    self.cache.prepare(sequence.block_table, sequence.num_computed, sequence.num_computed + count)
        if self.cross is not None:
            self.cross.encode_pending()  # the sources admitted this step, once each
        if any(sequence.stream is not None for sequence, _ in work):
            return mixed_forward(self, work)
        if self.compiled is not None and all(count == 1 and s.num_computed >= len(s.context) for s, count in work):
            sampled = [sequence for sequence, _ in work]  # every row decodes its last token
            return self.compiled.logits(sampled), sampled  # [B, V]
        return self.forward_rows(work)

    def forward_rows(self, work: Work) -> tuple[torch.Tensor, list[Sequence]]:
        """One flat varlen forward over ``work`` (engine/layout.py), its rows already writable."""
        device = self.model.device
        layout = flat_layout(work)  # engine/layout.py
        runs = fold_runs([(s, count) for s, _, count in layout.rows])  # FastSeq: beams folded on their prompt
        products = Products.of_rows(layout.is_prompt, self.threads, device,  # a row's arithmetic follows its role
                                    kernels=self.model.kernels)
        plan = StepPlan.for_rows(self.cache, [(s.block_table, start, count) for s, start, count in layout.rows],
                                 self.windows, self.score_bias, self.model.dtype, products, runs=runs)
        token_tensor = torch.tensor([layout.tokens], device=device)  # [1, N]
        position_tensor = torch.tensor([layout.positions], device=device)  # [1, N]
        logits_at = torch.tensor(layout.logits_at, dtype=torch.long, device=device)
        if self.cross is None:
            logits = forward_outputs(self.model, token_tensor, position_tensor, plan, logits_at, layout)  # [K, V]
        else:
            groups = row_groups([(s, count) for s, _, count in layout.rows])
            logits = self.model.decode(token_tensor, position_tensor, plan, self.cross.step(groups),
                                       logits_at=logits_at)[0]  # [K, V]
        return keep_logits(layout.scored, logits, len(layout.logit_rows)), layout.sampled  # scoring rows handed over
