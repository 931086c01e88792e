"""``best_of``: sample that many candidates per prompt in the engine and keep the
``num_return_sequences`` with the highest cumulative log-probability (each chosen token's
log-softmax of the raw logits, summed), best first, as OpenAI's and vLLM's ``best_of``. Candidate
j of a prompt samples with the seed of return sequence j (``sampling.sequence_seeds``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..config import GenerationConfig
from ..engine.call import submit_call
from ..engine.requests import RequestFactory
from ..engine.sequence import SequenceResult


def best_of_results(model: Any, factory: RequestFactory, prompts: list[list[int]], config: GenerationConfig,
                    check_stop: Callable[[], None]) -> list[SequenceResult]:
    """-> ``num_return_sequences`` results per prompt, each with its cumulative logprob as ``score``."""
    count, keep = config.best_of, config.num_return_sequences
    wide = dataclasses.replace(config, num_return_sequences=count, best_of=None)
    engine, sequences = submit_call(model, factory, factory.build_call(prompts, wide, logprobs=0))
    totals = {sequence.id: 0.0 for sequence in sequences}
    while engine.has_work():
        check_stop()
        for event in engine.step():
            if event.logprob is not None:
                totals[event.sequence.id] += event.logprob
    results = []
    for start in range(0, len(sequences), count):
        group = sorted(sequences[start : start + count], key=lambda s: -totals[s.id])
        results += [SequenceResult(s.output_ids, s.stop_kind, totals[s.id]) for s in group[:keep]]
    return results
