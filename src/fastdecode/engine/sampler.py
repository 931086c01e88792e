"""Choosing a step's tokens: every sampled row with its own sequence's options and generator.

A step of plain greedy rows (no processor active) is one argmax over all of them; otherwise each
row goes through its sequence's ``TokenSelector`` (processors, penalties, grammar, seeded draw).
The chosen ids come back to the host once per step; a finished sequence is released at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from ..decoding.sampling import greedy_tokens
from ..layers.threads import one_thread
from .beam_group import advance_groups
from .sequence import Sequence, TokenEvent, token_logprobs


def sample_rows(sampled: list[Sequence], logits: torch.Tensor,
                release: Callable[[Sequence], None]) -> list[TokenEvent]:
    """logits [K, V] of the K ``sampled`` sequences (one row each) -> their tokens' events."""
    if not sampled:
        return []
    if all(s.selector.plain_greedy(len(s.output_ids)) for s in sampled):
        chosen = greedy_tokens(logits)  # [K]: one op for a step of plain greedy rows (select's result)
    else:
        chosen = torch.cat([s.selector.select(logits[i : i + 1], len(s.output_ids)) for i, s in enumerate(sampled)])
    token_ids = chosen.tolist()  # the one host sync of the step
    wanted = [i for i, s in enumerate(sampled) if s.logprobs is not None]
    details: dict[int, tuple[float, list]] = {}
    if wanted:
        rows = torch.tensor(wanted, device=logits.device)
        top = max(sampled[i].logprobs for i in wanted)
        chosen_lp, tops = token_logprobs(logits[rows], chosen[rows], top)
        for j, i in enumerate(wanted):
            details[i] = (chosen_lp[j], tops[j][: sampled[i].logprobs] if sampled[i].logprobs else None)
    events = []
    for i, (sequence, token) in enumerate(zip(sampled, token_ids)):
        logprob, top_logprobs = details.get(i, (None, None))
        events.append(sequence.accept(token, logprob, top_logprobs))
        if sequence.finished:
            release(sequence)
    return events


class Sampler:
    """A step's tokens from its logits: a beam group's rows go to its policy (engine/beam_group.py),
    a verifying sequence's rows to the speculator (engine/speculative.py), every other row is
    sampled with its own options and generator (``sample_rows``)."""

    def __init__(self, speculator, release: Callable[[Sequence], None]):
        """``release``: the engine's bound method, held weakly (the engine owns this sampler: see Engine.__init__)."""
        self.speculator, self._release = speculator, weakref.WeakMethod(release)

    def release(self, sequence: Sequence) -> None:
        self._release()(sequence)

    def sample(self, sampled: list[Sequence], logits: torch.Tensor, running: list[Sequence]) -> list[TokenEvent]:
        """logits [K, V] of the K ``sampled`` sequences (``running``: the engine's, which beam groups reorder).
        On one torch thread: a row's processors and draw are small ops over one row, for which a second
        thread costs more at its barriers than it saves (a 16-row sampling step on 2 busy cores: 1.2 s on
        2 threads), and a row's bits then never depend on the thread count."""
        with one_thread():
            events = []
            if any(s.group is not None for s in sampled):
                sampled, logits, events = advance_groups(sampled, logits, running, self.release)
            if any(s.draft for s in sampled):  # verifying sequences keep what their rows confirm
                return events + self.speculator.sample(sampled, logits)
            return events + sample_rows(sampled, logits, self.release)
