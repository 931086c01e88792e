"""``echo`` on /v1/completions: the prompt leads each choice, and with ``logprobs`` so do the prompt
tokens' log-probabilities (the first token has none: nothing comes before it). This is how
evaluation harnesses score a text: ``max_tokens: 0, echo: true, logprobs: k``.

The prompt's logprobs come from a scoring sequence of the server's one engine (engine/scoring.py,
the pass behind ``Generator.score``), submitted to the engine thread as any request and run in the
same steps as everything else.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from .responses import ChoiceState, ResponseBuilder
from .worker import Failed, RequestSink, Submission

LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]  # (token id, logprob, top k)


@dataclass
class EchoedPrompt:
    text: str
    entries: list[LogprobEntry]  # one per prompt token (empty when logprobs were not asked)


class ScoringSubmission(Submission):
    """A prompt to score on the engine thread: its sequence keeps every position's logprobs."""

    def __init__(self, index: int, prompt_ids: list[int], top_logprobs: int, sink: RequestSink):
        super().__init__(index, prompt_ids, {}, sink, time.perf_counter())
        self.top_logprobs = top_logprobs

    def start(self, engine: Any) -> Any:
        return engine.submit_scoring(self.prompt_ids, self.top_logprobs)


async def echoed_prompts(worker: Any, generator: Any, encoded: list[tuple[list[int], str | None]],
                         logprobs: int | None) -> list[EchoedPrompt]:
    """Each prompt's text (a token prompt is decoded) and, when ``logprobs`` is set, its tokens'
    logprobs with the ``logprobs`` best alternatives, scored by ``worker``'s engine (all prompts at
    once); an APIError if the engine refuses one (a full queue...)."""
    sink = RequestSink(asyncio.get_running_loop())
    scoring = [] if logprobs is None else [ScoringSubmission(i, ids, logprobs, sink)
                                           for i, (ids, _) in enumerate(encoded) if len(ids) > 1]
    for submission in scoring:
        worker.submit(submission)
    pending = {submission.index for submission in scoring}
    while pending:
        item = await sink.queue.get()
        if isinstance(item, Failed):
            for submission in scoring:
                worker.cancel(submission)
            raise item.error
        if getattr(item, "finish_reason", None) is not None:  # the scoring sequence's end
            pending.discard(item.index)
    scored = {submission.index: submission.sequence for submission in scoring}
    echoed = []
    for index, (ids, text) in enumerate(encoded):
        if text is None:
            text = generator.tokenizer.decode(ids, skip_special_tokens=False)
        entries: list[LogprobEntry] = []
        if logprobs is not None:
            entries = [(ids[0], None, None)]
            if index in scored:
                sequence = scored[index]
                entries += [(token, lp, alternatives if logprobs else None)
                            for token, lp, alternatives in zip(ids[1:], sequence.logprobs, sequence.top)]
        echoed.append(EchoedPrompt(text, entries))
    return echoed


def prepend_echo(choices: list[ChoiceState], echoed: list[EchoedPrompt], n: int) -> None:
    """Choice i (of prompt i // n) starts with its prompt's text and logprob entries."""
    for choice in choices:
        prompt = echoed[choice.index // n]
        choice.text = prompt.text + choice.text
        choice.logprobs = prompt.entries + choice.logprobs


def echo_chunk(builder: ResponseBuilder, index: int, prompt: EchoedPrompt) -> dict[str, Any]:
    """A stream's first chunk for a choice: the prompt text (and its logprobs)."""
    logprobs = builder.logprobs_object(prompt.entries, streamed_choice=index) if builder.logprobs is not None else None
    return builder.chunk(index, prompt.text, logprobs, None)
