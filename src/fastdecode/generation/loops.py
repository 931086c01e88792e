"""The one call the engine does not run: the naive reference (``use_cache=False``,
generation/reference.py), with stop strings watched on the text as the engine watches them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..config import GenerationConfig
from ..engine.requests import RequestFactory
from ..engine.sequence import SequenceResult
from .reference import ReferenceLoop
from ..decoding.sampling import sequence_seeds
from ..decoding.stopping import TextWatcher


def runs_in_engine(config: GenerationConfig) -> bool:
    """Greedy, sampling, beam search and streams past n_ctx run in the engine (decoder-only and
    encoder-decoder models); the naive reference (use_cache=False) keeps its own loop."""
    return config.use_cache or config.n_ctx is not None


def decode_loops(model: Any, factory: RequestFactory, prompts: list[list[int]], config: GenerationConfig) -> list[Any]:
    """One reference loop for the whole batch (greedy and sampling)."""
    prompts = factory.check_call(prompts, config)
    repeated = [p for p in prompts for _ in range(config.num_return_sequences)]
    eos, grammar = factory.eos_ids(config), factory.grammar(config)
    seeds = sequence_seeds(config, len(prompts)) if config.is_sampling else None
    return [ReferenceLoop(model, repeated, config, eos, row_seeds=seeds, grammar=grammar)]


def loop_results(model: Any, factory: RequestFactory, prompts: list[list[int]], config: GenerationConfig,
                 check_stop: Callable[[], None]) -> list[SequenceResult]:
    """Every result of a call run through its decode loops; ``check_stop`` is called before each step."""
    stops = config.stop_strings()
    results: list[SequenceResult] = []
    for loop in decode_loops(model, factory, prompts, config):
        watchers = [TextWatcher(factory.require_tokenizer(), stops) for _ in loop.results] if stops else None
        for events in loop:
            check_stop()
            for index, token in events if watchers else ():
                watchers[index].push(token)
                if watchers[index].matcher.stopped:
                    loop.stop(index)
        results += loop.results
    return results


def loop_tokens(model: Any, factory: RequestFactory, prompt: list[int], config: GenerationConfig) -> Iterator[int]:
    """The tokens of one sequence as its decode loop produces them (up to a stop string's end)."""
    (loop,) = decode_loops(model, factory, [prompt], config)
    watcher = TextWatcher(factory.require_tokenizer(), config.stop_strings()) if config.stop_strings() else None
    for events in loop:
        for _, token in events:
            yield token
            if watcher is not None:
                watcher.push(token)
                if watcher.matcher.stopped:
                    loop.stop(0)


__all__ = ["decode_loops", "loop_results", "loop_tokens", "runs_in_engine"]
