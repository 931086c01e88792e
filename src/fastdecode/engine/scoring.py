"""Scoring as a sequence of the engine: ``Generator.score``, perplexity and the server's ``echo``
with prompt logprobs.

A scoring sequence runs the text's tokens but the last (``context``) as a prompt, in chunks, in
the same steps as everything else; unlike a generating sequence it keeps the logits of every
position it runs (not only its last), turns each chunk's logits into the log-probability of the
token that follows (and, when asked, the ``top`` best alternatives) at once, and then drops them,
so memory stays at ``SCORE_CHUNK x vocab`` per sequence whatever the length. It never samples: it
ends when its last position has run. It takes nothing from the prefix cache (every position's
logits are wanted), though the blocks it computes are named for later requests as any prompt's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import Any

import torch

from ..config import GenerationConfig
from ..errors import InvalidOptionError, QueueFullError
from .sequence import Sequence, TokenEvent, token_logprobs
from .slots import check_fits
from .streaming_policy import new_stream, stream_capacity

SCORE_CHUNK = 512  # positions a scoring sequence runs per step: its logits [SCORE_CHUNK, V] exist at once


class ScoringSequence(Sequence):
    """The text ``ids``; after it ends, ``logprobs[i]`` is log P(ids[i + 1] | ids[:i + 1]) and
    ``top[i]`` the ``top_logprobs`` best (token id, logprob) pairs there (empty lists when 0)."""

    keeps_logits = prompt_only = True
    chunk_limit = SCORE_CHUNK

    def __init__(self, seq_id: int, ids: list[int], top_logprobs: int):
        super().__init__(seq_id, ids, GenerationConfig(max_new_tokens=0), selector=None, eos_ids=[])
        self.context = ids[:-1]  # the positions whose logits predict ids[1:]
        self.top_logprobs = top_logprobs
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []

    def take_logits(self, logits: torch.Tensor) -> None:
        """logits [T, V] of the next T positions (raw)."""
        done, size = len(self.logprobs), logits.shape[0]
        targets = torch.tensor(self.prompt_ids[done + 1 : done + 1 + size], device=logits.device)  # [T]
        chosen, best = token_logprobs(logits, targets, self.top_logprobs)
        self.logprobs += chosen
        self.top += best


def scoring_sequence(engine: Any, ids: Seq[int], top_logprobs: int, seq_id: int,
                     stream_config: GenerationConfig | None = None) -> ScoringSequence:
    """A validated scoring sequence for ``engine`` (not yet queued). ``stream_config``: a config with
    ``n_ctx`` (and ``n_keep``, ``n_discard``, ``policy``): the text streams through that streaming
    policy on the sequence's own blocks (engine/stream_steps.py), as StreamingLLM is evaluated."""
    ids = list(ids)
    if len(ids) < 2:
        raise InvalidOptionError("scoring needs at least two tokens")
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or top_logprobs < 0:
        raise InvalidOptionError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
    vocab = engine.model.config.vocab_size
    if top_logprobs > vocab:
        raise InvalidOptionError(f"top_logprobs={top_logprobs} exceeds the vocabulary size {vocab}")
    if stream_config is not None and stream_config.n_ctx is not None:  # any length: the policy bounds what is held
        engine.requests.check_prompts([ids], stream_config)  # ids in the vocabulary, a decoder-only model
        if len(engine.waiting) >= engine.max_queue:
            raise QueueFullError(f"the engine's queue is full ({engine.max_queue} waiting requests)")
        sequence = ScoringSequence(seq_id, ids, top_logprobs)
        sequence.stream = new_stream(engine, stream_config)
        return sequence
    check_prompt_only(engine, ids, len(ids) - 1, "scoring", f"a text of {len(ids)} tokens to score")
    return ScoringSequence(seq_id, ids, top_logprobs)


def check_prompt_only(engine: Any, ids: list[int], positions: int, use: str, what: str) -> None:
    """Refuse a text to score or embed (``positions`` run) that ``engine`` could never run (an
    encoder-decoder model; no tokens, ids outside the vocabulary, past the context or the cache) or
    cannot queue now, with a typed error naming ``use`` / ``what``."""
    if engine.cross is not None:
        raise InvalidOptionError(f"{use} is for decoder-only models (an encoder-decoder model needs a source)")
    engine.requests.check_prompts([ids], GenerationConfig(max_new_tokens=0))  # ids in the vocabulary, context
    check_fits(positions, engine.cache, what, engine.max_chunk)
    if len(engine.waiting) >= engine.max_queue:
        raise QueueFullError(f"the engine's queue is full ({engine.max_queue} waiting requests)")


def keep_logits(scored: list[tuple[ScoringSequence, int]], logits: torch.Tensor, sampled: int) -> torch.Tensor:
    """A step's logits [K + sum of counts, V]: the K sampled rows first, then each scoring
    sequence's rows, in order -> hand those over, return the sampled rows [K, V]."""
    first = sampled
    for sequence, count in scored:
        sequence.take_logits(logits[first : first + count])
        first += count
    return logits[:sampled] if scored else logits


def finish_scored(work: list[tuple[Sequence, int]], release: Callable[[Sequence], None]) -> list[TokenEvent]:
    """End the scoring and embedding sequences of a step's ``work`` whose last position ran (after
    the step's K/V were recorded): their blocks go back through ``release``."""
    events = []
    for sequence, _ in work:
        if sequence.prompt_only and sequence.num_computed == sequence.num_tokens:
            events.append(sequence.end_event("length"))
            release(sequence)
    return events


def score_alone(generator: Any, ids: Seq[int], top_logprobs: int = 0,
                config: GenerationConfig | None = None) -> ScoringSequence:
    """Score one text in an engine of its own, sized for it (``Generator.score``; ``config`` with
    ``n_ctx``: through a stream of that size)."""
    streaming = config is not None and config.n_ctx is not None
    cache_tokens = stream_capacity(config) if streaming else len(ids)
    engine = generator.engine(cache_tokens=cache_tokens, max_queue=1, cuda_graphs=False)  # nothing decodes
    sequence = engine.submit_scoring(ids, top_logprobs, config)
    while engine.has_work():
        engine.step()
    return sequence
