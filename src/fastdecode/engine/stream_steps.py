"""Streams in the engine's steps: a sequence submitted with ``n_ctx`` carries a
``StreamingPolicy`` (engine/streaming_policy.py) on the engine's own cache.

Scheduling: a stream's next forward is the chunk its policy allows (``chunk_tokens``), taken
whole so that it runs the chunks a stream alone runs; a step takes at most one such chunk past
its prompt budget. Running: the step's forward lays out the ordinary rows first, then each
stream's chunk (``mixed_forward``); before it, each stream's policy shifts its own blocks
(``seq_add`` / ``seq_rm``) or, to re-evaluate, re-prefills its kept tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import GenerationConfig
from ..layers.products import Products
from .plan import StepPlan
from .layout import flat_layout
from .scoring import keep_logits
from .sequence import Sequence
from .stream_plan import MixedPlan, StreamPlan
from .streaming_policy import new_stream

if TYPE_CHECKING:
    from .runner import ModelRunner


def switch_to_stream(engine, kept: Sequence, config: GenerationConfig) -> None:
    """A kept sequence goes on as a stream (a chat past its context): its policy adopts the blocks
    it holds; when it cannot (engine/streaming_policy.py ``adopt``), they are freed and its
    resume feeds every token through the policy."""
    stream = new_stream(engine, config)
    if not stream.adopt(kept.block_table, kept.tokens(0, kept.num_computed)):
        engine.cache.release(kept.block_table)
        kept.num_computed = 0
    kept.block_table, kept.stream = [], stream


def chunk_tokens(sequence: Sequence, budget: int, untouched: bool, limit: int) -> int:
    """Tokens ``sequence`` runs this step with ``budget`` prompt tokens left (``untouched``: no
    chunk taken yet this step; ``limit``: the engine's longest chunk); 0: it waits."""
    remaining = sequence.num_tokens - sequence.num_computed
    if sequence.stream is None:
        return min(remaining, budget, limit)
    count = sequence.stream.chunk_size(remaining)
    return count if count <= budget or (untouched and budget > 0) else 0


def mixed_forward(engine: "ModelRunner", work: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
    """One forward over ``work`` with streams in it -> (logits [K, V], the K sequences sampled)."""
    model, device = engine.model, engine.model.device
    rows = [w for w in work if w[0].stream is None]
    streams = [w for w in work if w[0].stream is not None]
    layout = flat_layout(rows)  # engine/layout.py: drafts and scoring rows included
    tokens, positions, logit_rows, sampled, is_prompt = (layout.tokens, layout.positions, layout.logit_rows,
                                                         layout.sampled, layout.is_prompt)
    row_plan, threads = None, engine.threads  # the runner's thread budget
    if rows:
        row_products = Products.of_rows(list(is_prompt), threads, device, kernels=model.kernels)
        row_plan = StepPlan.for_rows(engine.cache, [(s.block_table, start, count) for s, start, count in layout.rows],
                                     engine.windows, engine.score_bias, model.dtype, row_products)
    plans, stream_kept, stream_scored = [], [], []
    for sequence, count in streams:
        start = sequence.num_computed
        chunk = sequence.tokens(start, start + count)
        roles = [index < len(sequence.context) for index in range(start, start + count)]
        plan = sequence.stream.begin(chunk, _rebuild_forward(model, all(roles)))
        plans.append(plan)
        tokens += chunk
        positions += plan.positions.tolist()
        is_prompt += roles
        if sequence.keeps_logits:  # a text scored through a stream: every row's logits (engine/scoring.py)
            stream_kept += range(len(tokens) - count, len(tokens))
            stream_scored.append((sequence, count))
        elif start + count == sequence.num_tokens:
            logit_rows.append(len(tokens) - 1)
            sampled.append(sequence)
    # a row's arithmetic follows its role (layers/products.py)
    products = Products.of_rows(is_prompt, threads, device, kernels=model.kernels)
    plan = MixedPlan(row_plan, sum(count for _, _, count in layout.rows), plans, products)
    token_tensor = torch.tensor([tokens], device=device)  # [1, N]
    position_tensor = torch.tensor([positions], device=device)  # [1, N]
    logits_at = torch.tensor(logit_rows + layout.kept_rows + stream_kept, dtype=torch.long, device=device)
    logits = model.forward(token_tensor, position_tensor, plan, logits_at=logits_at)[0]  # [K, V]
    for sequence, count in streams:
        sequence.stream.finish(count)
    return keep_logits(layout.scored + stream_scored, logits, len(logit_rows)), sampled


def _rebuild_forward(model, prompt: bool):
    """The re-evaluate policy's rebuild forwards, with the rows' role of the chunk that needs them."""

    def forward(piece: list[int], plan: StreamPlan) -> None:
        tokens = torch.tensor([piece], device=model.device)  # [1, T]
        plan.with_products(Products.of_rows(prompt, torch.get_num_threads(), model.device, kernels=model.kernels))
        model.forward(tokens, plan.positions[None], plan, False)

    return forward
