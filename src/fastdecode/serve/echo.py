"""``echo`` on /v1/completions: the prompt leads each choice, and with ``logprobs`` so do the prompt
tokens' log-probabilities (the first token has none: nothing comes before it). This is how
evaluation harnesses score a text: ``max_tokens: 0, echo: true, logprobs: k``.

The prompt's logprobs are one chunked forward pass (``generation.scoring.token_logprobs_of``, the
pass behind ``Generator.score``) on a worker thread, as beam search runs beside the engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ..config import GenerationConfig
from ..generation.scoring import token_logprobs_of
from .responses import ChoiceState, ResponseBuilder

LogprobEntry = tuple[int, float | None, list[tuple[int, float]] | None]  # (token id, logprob, top k)


@dataclass
class EchoedPrompt:
    text: str
    entries: list[LogprobEntry]  # one per prompt token (empty when logprobs were not asked)


async def echoed_prompts(generator: Any, encoded: list[tuple[list[int], str | None]],
                         logprobs: int | None) -> list[EchoedPrompt]:
    """Each prompt's text (a token prompt is decoded) and, when ``logprobs`` is set, its tokens'
    logprobs with the ``logprobs`` best alternatives."""
    echoed = []
    for ids, text in encoded:
        if text is None:
            text = generator.tokenizer.decode(ids, skip_special_tokens=False)
        entries: list[LogprobEntry] = []
        if logprobs is not None:
            entries = [(ids[0], None, None)]
            if len(ids) > 1:
                chosen, top = await asyncio.to_thread(token_logprobs_of, generator.model, ids, GenerationConfig(),
                                                      logprobs)
                entries += [(token, lp, alternatives if logprobs else None)
                            for token, lp, alternatives in zip(ids[1:], chosen, top)]
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
    logprobs = builder.logprobs_object(prompt.entries) if builder.logprobs is not None else None
    return builder.chunk(index, prompt.text, logprobs, None)
