"""One request inside the engine: its tokens, options, sampler state, stop conditions and cache blocks.

A sequence is only ``num_computed`` (tokens whose K/V are in the cache) versus ``num_tokens``
(prompt + generated): each step feeds it ``tokens[num_computed : num_computed + n]``, and when a
step reaches its last token the model's logits there choose the next one. There is no prefill
phase and no decode phase (vLLM v1's invariant): a prompt chunk, a prefix-cache hit and a decode
step are all the same move.

An encoder-decoder request's prompt is its *source*: the encoder reads it once, at admission
(engine/cross.py), and the tokens the decoder runs (``context``) are the model's decoder start
token(s) followed by the generated ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GenerationConfig
from ..decoding.sampling import TokenSelector


@dataclass
class TokenEvent:
    """One new token of one sequence (``engine.step()`` returns them in submission order).

    ``token_id`` is None only for an event that carries no token: a sequence cancelled, or one
    with ``max_new_tokens=0``, reports its end this way.
    """

    sequence: "Sequence"
    token_id: int | None
    text: str  # the new detokenized piece ("" while held back; stop strings never shown)
    logprob: float | None  # log-softmax of the raw logits at the chosen token (when asked)
    top_logprobs: list[tuple[int, float]] | None  # the k best (token id, logprob) (when asked)
    finished: bool
    finish_reason: str | None  # None | "stop" (EOS or stop string) | "length" | "cancelled"



@dataclass
class SequenceResult:
    """One finished sequence as the API returns it."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "eos", "length" or "stop"
    score: float | None = None  # beam search: the length-penalized sum of log-probabilities (HF sequences_scores)


def public_finish_reason(kind: str | None) -> str | None:
    """An internal finish kind ("eos", "stop" for a stop string, "length", "cancelled") -> the
    reason results report (OpenAI's): EOS and stop strings are both "stop"."""
    return "stop" if kind in ("eos", "stop") else kind


class Sequence:
    """A request: prompt ids, its own ``GenerationConfig`` and ``TokenSelector`` (seeded generator,
    repetition-penalty mask, n-gram history), stop watcher, and the cache blocks it owns."""

    keeps_logits = False  # a scoring sequence (engine/scoring.py) keeps every position's logits
    embeds = False  # an embedding sequence (engine/embedding_rows.py) takes hidden states instead of logits
    # scoring and embedding sequences: they end once their last position has run, sampling nothing, and
    # take nothing from the prefix cache (they want what every position computes)
    prompt_only = False
    chunk_limit = 1 << 62  # the most tokens one step runs of it (scoring caps it: its logits are kept)

    def __init__(self, seq_id: int, prompt_ids: list[int], config: GenerationConfig, selector: TokenSelector,
                 eos_ids: list[int], watcher: Any = None, logprobs: int | None = None,
                 decoder_prompt: list[int] | None = None):
        self.id = seq_id
        self.prompt_ids = prompt_ids  # the request's prompt (an encoder-decoder model's source)
        # What the (decoder's) self-attention runs before the generated tokens: the prompt, or for an
        # encoder-decoder request the decoder start token(s), with the prompt as ``source``.
        self.context = prompt_ids if decoder_prompt is None else decoder_prompt
        self.source = None if decoder_prompt is None else prompt_ids
        self.source_table: list[int] = []  # blocks of its cross-attention K/V (engine/cross.py)
        self.keep_cache = False  # a kept sequence (chat session): its blocks outlive its end
        self.output_ids: list[int] = []
        self.config = config
        self.selector = selector
        self.eos_ids = set(eos_ids)
        self.watcher = watcher  # decoding.stopping.TextWatcher, or None (no text wanted)
        self.logprobs = logprobs
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached_prompt_tokens = 0  # prompt tokens served by the prefix cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache names of its full computed blocks
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled"
        self.stop_kind: str | None = None  # finer: "eos" | "stop" (a stop string) | "length" | "cancelled"
        self.cancel_requested = False
        self.speculation: Any = None  # engine/speculative.py's Speculation for a speculating sequence
        self.draft: list[int] = []  # the draft tokens it verifies in the current step
        self.stream: Any = None  # a stream past n_ctx: its StreamingPolicy (engine/streaming_policy.py)
        self.group: Any = None  # engine/beam_group.py's BeamGroup of a beam search's root and beams
        # A context position whose logits the step that runs it hands over (``take_logits``): a
        # Whisper prompt's <|startoftranscript|>, whose logits give the no-speech probability.
        self.prompt_logits_at: int | None = None
        self.prompt_logits: torch.Tensor | None = None  # [V], once that position has run

    def take_logits(self, logits: torch.Tensor) -> None:
        """The logits [1, V] at ``prompt_logits_at`` (a scoring sequence takes every position's)."""
        self.prompt_logits = logits[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.context) + len(self.output_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) of context (the prompt, or the decoder start) + output."""
        context = self.context
        if end <= len(context):
            return context[start:end]
        return (context + self.output_ids)[start:end]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def total_tokens(self) -> int:
        """Cache slots the sequence may need: its context and every token it may generate."""
        return len(self.context) + self.config.max_new_tokens

    def cancel(self) -> None:
        """Ask the engine to drop this sequence; its slots are free after the next ``step()``."""
        self.cancel_requested = True

    def finish(self, kind: str) -> None:
        self.stop_kind = kind
        self.finish_reason = public_finish_reason(kind)

    def accept(self, token: int, logprob: float | None = None,
               top_logprobs: list[tuple[int, float]] | None = None) -> TokenEvent:
        """Append a chosen token, check EOS / length / stop strings -> its event."""
        self.output_ids.append(token)
        if self.speculation is not None:
            self.speculation.drafter.extend([token])
        text = self.watcher.push(token) if self.watcher is not None else ""
        if token in self.eos_ids:
            self.finish("eos")
        elif self.watcher is not None and self.watcher.matcher.stopped:
            self.finish("stop")
        elif self.config.max_new_tokens is not None and len(self.output_ids) >= self.config.max_new_tokens:
            self.finish("length")
        if self.finished and self.watcher is not None:
            text += self.watcher.finish()
        return TokenEvent(self, token, text, logprob, top_logprobs, self.finished, self.finish_reason)

    def end_event(self, kind: str) -> TokenEvent:
        """Finish without a token (cancelled, or nothing to generate)."""
        self.finish(kind)
        return TokenEvent(self, None, "", None, None, True, self.finish_reason)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> tuple[list[float], list[list]]:
    """logits [K, V] (raw), chosen tokens [K] -> each chosen token's log-probability and the
    ``top`` best (token id, log-probability) pairs per row."""
    logprobs = logits.float().log_softmax(dim=-1)  # [K, V]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    if top <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = logprobs.topk(top, dim=-1)  # [K, top]
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
