"""Whisper's decoding of a batch of windows: the logits rules, then greedy, sampling or beam search.

Rules, in Whisper's order, on each row's logits: the suppressed tokens (every step), blank and
end-of-text at the first sampled step, and with timestamps the timestamp rules (timestamps come
in pairs, never decrease, the first token is a timestamp no later than
``max_initial_timestamp``, and a timestamp is forced when their total probability beats every
text token). Beam search is CTranslate2's (faster-whisper's engine): per window the 2K best
candidates by summed log-probability; each of the first K that ends is finished and its place
goes to the next that does not; with patience 1 the window is done once its best candidate ends,
else once it holds ``round(K * patience)`` finished; the result is the finished candidate of the
best summed log-probability divided by its length. With K=1 and temperature 0 it is greedy decoding; a temperature above 0
samples ``best_of`` independent rows per window and keeps the best by the same score.

The search drives an engine with the verbs of speech/engine.py's ``WhisperEngine``
(``start``, ``decode``, ``reorder_beams``, ``keep_samples``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers.threads import one_thread
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


@dataclass
class WindowResult:
    tokens: list[int]  # generated, without end-of-text
    sum_logprob: float
    no_speech_prob: float = 0.0
    avg_logprob: float = field(init=False)

    def __post_init__(self):
        self.avg_logprob = self.sum_logprob / (len(self.tokens) + 1)


class LogitsRules:
    """Whisper's logits rules for rows whose generated tokens (after the prompt) are known."""

    def __init__(self, vocabulary: WhisperVocabulary, options: SearchOptions, vocab_size: int, device):
        self.vocab, self.options = vocabulary, options
        special = [vocabulary.transcribe, vocabulary.translate, vocabulary.sot, vocabulary.sot_prev,
                   vocabulary.sot_lm, vocabulary.no_speech] + ([vocabulary.no_timestamps] if options.timestamps else [])
        always = {t for t in [*options.suppress_tokens, *special] if t is not None and 0 <= t < vocab_size}
        self.always = torch.tensor(sorted(always), dtype=torch.long, device=device)  # token ids suppressed
        self.at_begin = list(options.suppress_at_begin) or [vocabulary.encode(" ")[0], vocabulary.eot]

    def apply(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """logits [R, V] (float32: changed in place) for rows with these generated tokens -> masked logits."""
        logits = logits.float().index_fill_(1, self.always, float("-inf"))  # [R, V]
        for row, tokens in enumerate(generated):
            if not tokens:
                logits[row, self.at_begin] = float("-inf")
        if self.options.timestamps:
            self._timestamp_rules(logits, generated)
        return logits

    def _timestamp_rules(self, logits: torch.Tensor, generated: list[list[int]]) -> None:
        begin, eot = self.vocab.timestamp_begin, self.vocab.eot
        for row, tokens in enumerate(generated):
            last_was = len(tokens) >= 1 and tokens[-1] >= begin
            penultimate_was = len(tokens) < 2 or tokens[-2] >= begin
            if last_was:
                if penultimate_was:  # a pair closed: text (or end) comes next
                    logits[row, begin:] = float("-inf")
                else:  # an opening timestamp without text after it: another timestamp or the end
                    logits[row, :eot] = float("-inf")
            stamps = [t for t in tokens if t >= begin]
            if stamps:  # never decreasing; never repeating, except to close a pair
                last = stamps[-1] if last_was and not penultimate_was else stamps[-1] + 1
                logits[row, begin:last] = float("-inf")
            if not tokens:  # the first token is a timestamp, and an early one
                logits[row, :begin] = float("-inf")
                logits[row, begin + self.options.max_initial_timestamp_index + 1:] = float("-inf")
        # the timestamps' total probability against the likeliest text token's (the softmax
        # normalizer is the same on both sides, so the logits compare as the log-probabilities)
        stamp_mass = torch.logsumexp(logits[:, begin:], dim=-1)  # [R]
        best_text = logits[:, :begin].max(dim=-1).values  # [R]
        logits[stamp_mass > best_text, :begin] = float("-inf")


def search(engine, vocabulary: WhisperVocabulary, prompts: list[list[int]], sot_index: list[int],
           options: SearchOptions) -> list[WindowResult]:
    """Decode B windows (the engine holds their cross K/V) from their prompts -> one result each."""
    sampling = options.temperature > 0
    K = options.best_of if sampling else options.beam_size
    B = len(prompts)
    logits, sot_logits = engine.start(prompts, sot_index)  # [B, V] each
    no_speech = [0.0] * B
    if vocabulary.no_speech is not None:
        no_speech = sot_logits.float().softmax(dim=-1)[:, vocabulary.no_speech].tolist()
    rules = LogitsRules(vocabulary, options, logits.shape[-1], logits.device)
    generator = None
    if sampling:
        generator = torch.Generator(device=logits.device)
        generator.manual_seed(options.seed if options.seed is not None else torch.seed())
    max_new = min(options.max_length - max(len(p) for p in prompts), engine.max_new_tokens)
    candidates = K if sampling else max(1, round(K * options.patience))
    state = _Beams(B, K, candidates, vocabulary.eot, [len(p) for p in prompts])
    state.early_exit = not sampling and options.patience == 1
    first = True
    for step in range(max_new):
        rows = state.open_rows()
        if first:  # one row per window so far: every beam of it is the same
            generated = [[] for _ in range(len(rows) // K)]
        else:
            generated = [state.tokens[r] for r in rows]
        with one_thread():  # small ops on one thread (an OpenMP barrier costs more than the work: beam.py)
            masked = rules.apply(logits, generated)
            if sampling:
                masked = masked / options.temperature
            logprobs = torch.log_softmax(masked, dim=-1)  # [rows or B, V]
            if first:
                logprobs = logprobs.repeat_interleave(K, dim=0)  # [B*K, V]
            last = step + 1 == max_new
            if sampling:
                choice = torch.multinomial(logprobs.exp(), 1, generator=generator)[:, 0]  # [R]
                picked = logprobs.gather(1, choice[:, None])[:, 0]
                state.advance_independent(choice.tolist(), picked.tolist(), last)
            else:
                top_lp, top_tokens = logprobs.topk(2 * K, dim=-1)  # [R, 2K]
                state.advance_beams(top_lp.tolist(), top_tokens.tolist(), first, last)
        first = False
        if state.finished_all():
            break
        samples, sources = state.compact()
        if samples is not None:
            engine.keep_samples(torch.tensor(samples))
        engine.reorder_beams(torch.tensor(sources))
        rows = state.open_rows()
        tokens = torch.tensor([state.tokens[r][-1] for r in rows], device=logits.device)
        positions = torch.tensor([state.prompt_lengths[state.sample_of(r)] + len(state.tokens[r]) - 1 for r in rows],
                                 device=logits.device)
        logits = engine.decode(tokens, positions)  # [R, V]
    return [WindowResult(tokens, score, no_speech[b]) for b, (tokens, score) in enumerate(state.best())]


class _Beams:
    """Per window: K open rows (tokens, summed log-probability) and its finished candidates."""

    def __init__(self, B: int, K: int, max_candidates: int, eot: int, prompt_lengths: list[int]):
        self.B, self.K, self.max_candidates, self.eot = B, K, max_candidates, eot
        self.prompt_lengths = prompt_lengths
        self.tokens: list[list[int]] = [[] for _ in range(B * K)]  # row b*K+j of window b
        self.scores = [0.0] * (B * K)
        # per window: key (a running count in beam search, the row when sampling) -> (tokens, summed log-prob)
        self.finished: list[dict] = [{} for _ in range(B)]
        self.done: set[int] = set()  # sampled rows that ended
        self.top_finished = [False] * B
        self.early_exit = False
        self.open = list(range(B))  # windows the engine still holds, in its order
        self.sources: list[int] = list(range(B * K))

    def sample_of(self, row: int) -> int:
        return row // self.K

    def open_rows(self) -> list[int]:
        return [b * self.K + j for b in self.open for j in range(self.K)]

    def advance_beams(self, top_lp, top_tokens, first: bool, last: bool) -> None:
        """top_lp, top_tokens: per open row, its 2K best continuations. Per window, the 2K best
        candidates by summed log-probability: each of the first K that ends is finished (the
        window's search is over once the best candidate ends) and its place goes to the next
        candidate that does not end."""
        K = self.K
        new_tokens, new_scores, sources = list(self.tokens), list(self.scores), []
        for index, b in enumerate(self.open):
            candidates = []  # (summed log-prob, source row in the engine, token, source row's own index)
            for j in ([0] if first else range(K)):  # the first step: one real beam
                row = b * K + j
                candidates += [(self.scores[row] + lp, index * K + j, token, row)
                               for lp, token in zip(top_lp[index * K + j], top_tokens[index * K + j])]
            candidates.sort(key=lambda c: -c[0])
            candidates = candidates[: 2 * K]
            secondary = K
            for k in range(K):
                score, source, token, row = candidates[k]
                if token == self.eot or last:
                    ended = tuple(self.tokens[row]) if token == self.eot else (*self.tokens[row], token)
                    self.finished[b][len(self.finished[b])] = (ended, score)
                    if k == 0:
                        self.top_finished[b] = True
                    while secondary < len(candidates) and candidates[secondary][2] == self.eot:
                        secondary += 1
                    if secondary == len(candidates):
                        score = float("-inf")  # no candidate left that goes on: this beam is dead
                    else:
                        score, source, token, row = candidates[secondary]
                        secondary += 1
                new_tokens[b * K + k], new_scores[b * K + k] = [*self.tokens[row], token], score
                sources.append(source)
        self.tokens, self.scores, self.sources = new_tokens, new_scores, sources

    def advance_independent(self, tokens: list[int], logprobs: list[float], last: bool) -> None:
        """Sampling: each open row appends its token; a row ending (or out of room) is finished (and
        runs on with its window, ignored, until every row of the window has ended)."""
        K = self.K
        for index, row in enumerate(self.open_rows()):
            if row not in self.done:
                self.scores[row] += logprobs[index]
                if tokens[index] == self.eot or last:
                    ended = self.tokens[row] if tokens[index] == self.eot else [*self.tokens[row], tokens[index]]
                    self.finished[row // K][row] = (tuple(ended), self.scores[row])
                    self.done.add(row)
            self.tokens[row] = [*self.tokens[row], tokens[index]]
        self.sources = list(range(len(self.open) * K))

    def window_done(self, b: int) -> bool:
        """Beam search with patience 1 ends a window once its best candidate has ended; otherwise
        (and when sampling) once it holds ``max_candidates`` finished candidates."""
        if self.early_exit:
            return self.top_finished[b]
        return len(self.finished[b]) >= self.max_candidates

    def finished_all(self) -> bool:
        return all(self.window_done(b) for b in self.open)

    def compact(self) -> tuple[list[int] | None, list[int]]:
        """Windows whose finished set is full leave -> (their engine sample indices kept or None,
        each remaining row's source row within the kept engine rows)."""
        K = self.K
        keep = [i for i, b in enumerate(self.open) if not self.window_done(b)]
        position = {i: n for n, i in enumerate(keep)}
        sources = [position[s // K] * K + s % K for s in self.sources if s // K in position]
        if len(keep) == len(self.open):
            return None, sources
        self.open = [self.open[i] for i in keep]
        return keep, sources

    def best(self) -> list[tuple[list[int], float]]:
        """Per window: the finished candidate of the best summed log-probability per token."""
        results = []
        for finished in self.finished:
            tokens, score = max(finished.values(), key=lambda item: item[1] / max(1, len(item[0])))
            results.append((list(tokens), score))
        return results
