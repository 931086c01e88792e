"""Whisper's decoding of one window, as the policy of a group of sequences in the one engine.

A window's search is a request of the engine (engine/scheduler.py) whose source is the window's
encoded cross K/V (engine/speech_source.py), whose decoder prompt is the special-token prompt,
and which runs as a group of K rows (engine/beam_group.py): greedy decoding is a group of one, beam
search K = ``beam_size`` beams, temperature sampling K = ``best_of`` independent rows. The group
calls ``WindowSearch.advance`` with its rows' logits after each forward; the rows move as it says
(a beam reorder copies block tables, never K/V), beside every other request's rows.

Per step, Whisper's logits rules (speech/rules.py) mask each row's logits, then log-softmax.
Beam search is CTranslate2's (faster-whisper's engine): the 2K best candidates by summed
log-probability; each of the first K that ends is finished and its place goes to the next that
does not; with patience 1 the window is done once its best candidate ends, else once it holds
``round(K * patience)`` finished; the result is the finished candidate of the best summed
log-probability divided by its length. With K=1 and temperature 0 it is greedy decoding; a
temperature above 0 samples K independent rows (one seeded generator per window: a window samples
the same alone or batched) and keeps the best by the same score.

``LanguageDetection`` is the policy of a one-step request: the likeliest language token after
``<|startoftranscript|>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engine.sequence import SequenceResult
from ..layers import ops
from ..layers.threads import one_thread
from .rules import LogitsRules
from .vocabulary import WhisperVocabulary


@dataclass(frozen=True)
class SearchOptions:
    beam_size: int = 5
    patience: float = 1.0
    temperature: float = 0.0
    best_of: int = 5  # rows sampled per window when temperature > 0
    max_length: int = 448  # prompt and generated tokens together (the decoder's positions)
    timestamps: bool = False
    suppress_tokens: tuple[int, ...] = ()
    suppress_at_begin: tuple[int, ...] = ()
    max_initial_timestamp_index: int = 50
    seed: int | None = None

    @property
    def rows(self) -> int:
        """The rows of a window's group: ``best_of`` samples, or ``beam_size`` beams."""
        return self.best_of if self.temperature > 0 else self.beam_size


@dataclass
class WindowResult:
    tokens: list[int]  # generated, without end-of-text
    sum_logprob: float
    no_speech_prob: float = 0.0
    avg_logprob: float = field(init=False)

    def __post_init__(self):
        self.avg_logprob = self.sum_logprob / (len(self.tokens) + 1)


class WindowSearch:
    """One window's K rows (tokens, summed log-probability) and its finished candidates; the
    ``advance`` / ``results`` of a group policy (engine/beam_group.py's ``GroupPolicy``)."""

    def __init__(self, vocabulary: WhisperVocabulary, options: SearchOptions, prompt_length: int, vocab_size: int,
                 device: torch.device):
        self.options, self.eot = options, vocabulary.eot
        self.sampling = options.temperature > 0
        self.K = K = options.rows
        self.max_new = max(1, options.max_length - prompt_length)
        self.max_candidates = K if self.sampling else max(1, round(K * options.patience))
        self.early_exit = not self.sampling and options.patience == 1
        self.rules = LogitsRules(vocabulary, options, vocab_size, device)
        self.generator = None
        if self.sampling:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(options.seed if options.seed is not None else torch.seed())
        self.tokens: list[list[int]] = [[] for _ in range(K)]
        self.scores = [0.0] * K
        self.finished: dict = {}  # key (a running count in beam search, the row when sampling) -> (tokens, sum)
        self.done: set[int] = set()  # sampled rows that ended
        self.top_finished = False
        self.step = 0

    def advance(self, logits: torch.Tensor, selector=None) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """The rows' logits [K, V] (at the first step every row is the prompt's) -> (whether the
        window goes on, the row each new row continues [K], the new rows' last tokens [K])."""
        first, K = self.step == 0, self.K
        rows = logits[:1] if first else logits  # the first step: one real row
        generated = [[]] if first else self.tokens
        last = self.step + 1 == self.max_new
        with one_thread():  # small ops on one thread (an OpenMP barrier costs more than the work)
            masked = self.rules.apply(rows, generated)
            if self.sampling:
                masked = masked / self.options.temperature
            if self.sampling:
                logprobs = torch.log_softmax(masked, dim=-1)  # [1 or K, V]
                logprobs = logprobs.expand(K, -1) if first else logprobs  # [K, V]
                choice = torch.multinomial(logprobs.exp(), 1, generator=self.generator)[:, 0]  # [K]
                picked = logprobs.gather(1, choice[:, None])[:, 0]
                sources = self._advance_independent(choice.tolist(), picked.tolist(), last)
            else:
                running = torch.tensor(self.scores[: masked.shape[0]], dtype=torch.float32)  # [1 or K]
                scores, flat = best_candidates(masked, running, 2 * K)  # [2K] each: row * V + token
                V = masked.shape[1]
                candidates = [(score, index // V, index % V) for score, index in zip(scores.tolist(), flat.tolist())]
                sources = self._advance_beams(candidates, last)
        self.step += 1
        go_on = not self._done()
        moves = torch.tensor([sources, [t[-1] for t in self.tokens]], device=logits.device)  # [2, K]: one tensor made
        return go_on, moves[0], moves[1]

    def _advance_beams(self, candidates: list[tuple[float, int, int]], last: bool) -> list[int]:
        """candidates: the 2K best (summed log-probability, source row, token), best first. Each of
        the first K that ends is finished (the search is over once the best candidate ends) and its
        place goes to the next candidate that does not end."""
        K = self.K
        new_tokens, new_scores, sources = [], [], []
        secondary = K
        for k in range(K):
            score, source, token = candidates[k]
            if token == self.eot or last:
                ended = tuple(self.tokens[source]) if token == self.eot else (*self.tokens[source], token)
                self.finished[len(self.finished)] = (ended, score)
                if k == 0:
                    self.top_finished = True
                while secondary < len(candidates) and candidates[secondary][2] == self.eot:
                    secondary += 1
                if secondary == len(candidates):
                    score = float("-inf")  # no candidate left that goes on: this beam is dead
                else:
                    score, source, token = candidates[secondary]
                    secondary += 1
            new_tokens.append([*self.tokens[source], token])
            new_scores.append(score)
            sources.append(source)
        self.tokens, self.scores = new_tokens, new_scores
        return sources

    def _advance_independent(self, tokens: list[int], logprobs: list[float], last: bool) -> list[int]:
        """Sampling: each row appends its token; a row ending (or out of room) is finished (and runs
        on, ignored, until every row of the window has ended)."""
        for row in range(self.K):
            if row not in self.done:
                self.scores[row] += logprobs[row]
                if tokens[row] == self.eot or last:
                    ended = self.tokens[row] if tokens[row] == self.eot else [*self.tokens[row], tokens[row]]
                    self.finished[row] = (tuple(ended), self.scores[row])
                    self.done.add(row)
            self.tokens[row] = [*self.tokens[row], tokens[row]]
        return list(range(self.K))

    def _done(self) -> bool:
        """Beam search with patience 1 ends once its best candidate has ended; otherwise (and when
        sampling) once it holds ``max_candidates`` finished candidates."""
        if self.early_exit:
            return self.top_finished
        return len(self.finished) >= self.max_candidates

    def best(self) -> tuple[list[int], float]:
        """The finished candidate of the best summed log-probability per token."""
        tokens, score = max(self.finished.values(), key=lambda item: item[1] / max(1, len(item[0])))
        return list(tokens), score

    def results(self) -> list[SequenceResult]:
        tokens, score = self.best()
        return [SequenceResult(tokens, "eos", score)]

    def window_result(self, sot_logits: torch.Tensor | None, no_speech: int | None) -> WindowResult:
        """The window's result; ``sot_logits`` [V]: the logits at the prompt's <|startoftranscript|>."""
        tokens, score = self.best()
        probability = 0.0
        if no_speech is not None and sot_logits is not None:
            probability = float(sot_logits.float().softmax(dim=-1)[no_speech])
        return WindowResult(tokens, score, probability)


_NO_BANS = torch.zeros(0, dtype=torch.long)  # the rules have masked the logits already


def best_candidates(masked: torch.Tensor, running: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best continuations of rows with logits ``masked`` [R, V] (the rules applied) and
    summed log-probabilities ``running`` [R]: their scores running[r] + log_softmax(masked)[r, v]
    and flat indices r * V + v [keep], best first (ties: the lower index). One pass of the C++ op
    (layers/beam_search.cpp: no [R, V] tensor written, no sort) where it is built, else PyTorch."""
    if ops.available() and masked.is_cpu:
        scores, flat = ops.beam_candidates(masked.contiguous(), running, _NO_BANS, masked.shape[0], keep, 1)
        return scores[0], flat[0]
    total = torch.log_softmax(masked, dim=-1) + running.to(masked.device)[:, None]  # [R, V]
    return total.view(-1).topk(keep)


class LanguageDetection:
    """The policy of a one-step request with the prompt ``<|startoftranscript|>``: the likeliest
    language token there, and its probability among the language tokens."""

    def __init__(self, vocabulary: WhisperVocabulary):
        self.vocabulary = vocabulary
        self.language: tuple[str, float] | None = None

    def advance(self, logits: torch.Tensor, selector=None) -> tuple[bool, torch.Tensor, torch.Tensor]:
        vocab = self.vocabulary
        ids = torch.tensor(list(vocab.languages.values()), device=logits.device)
        probs = logits[0, ids].float().softmax(dim=-1)  # [languages]
        best = int(probs.argmax())
        self.language = (vocab.language_code(int(ids[best])), float(probs[best]))
        empty = torch.zeros(0, dtype=torch.long, device=logits.device)
        return False, empty, empty

    def results(self) -> list[SequenceResult]:
        return [SequenceResult([], "length", 0.0)]
