"""A development stand-in for ``fastdecode.engine`` (issue 11), used only while it is not importable.

It implements the engine interface the server is written against (``submit`` / ``step`` /
``has_work`` / ``Sequence.cancel``, ``TokenEvent``) over today's per-sequence decode loop: one
loop per sequence, and each ``step()`` advances every running sequence by one token. Results are
exactly ``Generator.stream_ids``' (same loop, same stop-string watcher); nothing is batched and
there is no prefix cache (``num_cached_prompt_tokens`` is always 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import InvalidOptionError, QueueFullError

_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class TokenEvent:
    sequence: "Sequence"
    token_id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class Sequence:
    id: int
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    num_cached_prompt_tokens: int = 0
    cancelled: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def cancel(self) -> None:
        self.cancelled = True


class _LogprobRecorder:
    """Wraps a decode loop's token selector to keep log-softmax of the raw logits it was given."""

    def __init__(self, selector: Any, top: int):
        self._selector = selector
        self._top = top
        self.last: tuple[float, list[tuple[int, float]] | None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._selector, name)

    def select(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        tokens = self._selector.select(logits, num_generated)  # [1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)[0]  # [V]
        top = None
        if self._top > 0:
            values, ids = logprobs.topk(self._top)
            top = list(zip(ids.tolist(), values.tolist()))
        self.last = (float(logprobs[int(tokens[0])]), top)
        return tokens


class _Running:
    def __init__(self, sequence: Sequence, loop: Any, steps: Any, watcher: Any, recorder: _LogprobRecorder | None):
        self.sequence, self.loop, self.steps, self.watcher, self.recorder = sequence, loop, steps, watcher, recorder


class AdapterEngine:
    """Same interface as ``fastdecode.engine.Engine``; one decode loop per sequence, stepped in turn."""

    def __init__(self, generator: Any, max_batch_tokens: int = 2048, max_queue: int = 256):
        self.generator = generator
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self._ids = itertools.count()
        self._running: list[_Running] = []

    def submit(self, prompt_ids: Seq[int], options: dict[str, Any]) -> Sequence:
        from .sessions import text_watcher

        options = dict(options)
        top = options.pop("logprobs", None)
        gen = self.generator
        config = gen._options(options)
        if config.num_beams > 1:
            raise InvalidOptionError("beam search runs outside the engine: use Generator.generate_ids_with_details")
        if config.num_return_sequences != 1:
            raise InvalidOptionError("the engine runs one sequence per submit: num_return_sequences must be 1")
        if sum(not r.sequence.cancelled for r in self._running) >= self.max_queue:
            raise QueueFullError(f"the engine queue is full ({self.max_queue} sequences)")
        (loop,) = gen._loops([list(prompt_ids)], config)
        recorder = None
        if top is not None:
            recorder = loop.selector = _LogprobRecorder(loop.selector, int(top))
        watcher = text_watcher(gen._require_tokenizer(), config.stop_strings())
        sequence = Sequence(next(self._ids), list(prompt_ids))
        self._running.append(_Running(sequence, loop, iter(loop), watcher, recorder))
        return sequence

    def has_work(self) -> bool:
        return bool(self._running)

    def step(self) -> list[TokenEvent]:
        events: list[TokenEvent] = []
        with torch.inference_mode():
            for running in list(self._running):
                event = self._advance(running)
                if event is not None:
                    events.append(event)
                if running.sequence.finished:
                    self._running.remove(running)
        return events

    def _advance(self, running: _Running) -> TokenEvent | None:
        sequence, loop = running.sequence, running.loop
        if sequence.cancelled:
            running.steps.close()
            sequence.finished, sequence.finish_reason = True, "cancelled"
            return None
        step_events = next(running.steps, None)
        if step_events is None:  # max_new_tokens == 0: the loop ends without a token
            sequence.finished, sequence.finish_reason = True, "length"
            return TokenEvent(sequence, -1, running.watcher.finish(), finished=True, finish_reason="length")
        ((_, token),) = step_events
        sequence.output_ids.append(token)
        text = running.watcher.push(token)
        if running.watcher.matcher.stopped:
            loop.stop(0)
        reason = loop.results[0].finish_reason
        if reason is not None:
            text += running.watcher.finish()
            running.steps.close()
            sequence.finished, sequence.finish_reason = True, _FINISH_REASONS[reason]
        logprob, top = running.recorder.last if running.recorder is not None else (None, None)
        return TokenEvent(sequence, token, text, logprob, top, sequence.finished, sequence.finish_reason)


def engine_for(generator: Any, max_batch_tokens: int, max_queue: int) -> Any:
    """The real engine when ``fastdecode.engine`` exists, else this adapter."""
    try:
        import fastdecode.engine  # noqa: F401
    except ImportError:
        return AdapterEngine(generator, max_batch_tokens, max_queue)
    return generator.engine(max_batch_tokens=max_batch_tokens, max_queue=max_queue)
