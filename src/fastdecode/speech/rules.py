"""Whisper's logits rules, in Whisper's order, on each row's logits.

The suppressed tokens (every step), blank and end-of-text at the first sampled step, and with
timestamps the timestamp rules (timestamps come in pairs, never decrease, the first token is a
timestamp no later than ``max_initial_timestamp``, and a timestamp is forced when their total
probability beats every text token). The window's search (speech/search.py) applies them before
its log-softmax, as Whisper and CTranslate2 do.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ..layers import ops
from .vocabulary import WhisperVocabulary

if TYPE_CHECKING:  # pragma: no cover
    from .search import SearchOptions


class LogitsRules:
    """Whisper's logits rules for rows whose generated tokens (after the prompt) are known."""

    def __init__(self, vocabulary: WhisperVocabulary, options: "SearchOptions", vocab_size: int, device):
        self.vocab, self.options = vocabulary, options
        special = [vocabulary.transcribe, vocabulary.translate, vocabulary.sot, vocabulary.sot_prev,
                   vocabulary.sot_lm, vocabulary.no_speech] + ([vocabulary.no_timestamps] if options.timestamps else [])
        always = {t for t in [*options.suppress_tokens, *special] if t is not None and 0 <= t < vocab_size}
        self.always = torch.tensor(sorted(always), dtype=torch.long, device=device)  # token ids suppressed
        self.at_begin = list(options.suppress_at_begin) or [vocabulary.encode(" ")[0], vocabulary.eot]
        self._masked: torch.Tensor | None = None  # the last call's result, overwritten by the next
        # the one-op rules' (whisper_rules.cpp) token ids and ints
        self._at_begin_ids = torch.tensor(self.at_begin, dtype=torch.long)
        self._op_ints = [int(options.timestamps), vocabulary.timestamp_begin if options.timestamps else 0,
                         vocabulary.eot, options.max_initial_timestamp_index]

    def apply(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """logits [R, V] for rows with these generated tokens -> masked logits [R, V] (float32, a copy
        in a buffer that the next call overwrites: a beam-5 step's [5, 51864] copy took 146 us into a
        fresh tensor against 73 us into a kept one, one core). Float32 rows on the CPU take the one-op rules
        (whisper_rules.cpp: the same values and decisions, ~20 torch ops a step fewer), else ``apply_python``."""
        masked = self._buffer(logits)
        if ops.available() and logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2:
            begin, rows = self._op_ints[1], []
            for tokens in generated:
                latest = _last_timestamp(tokens, begin) if self.options.timestamps else None
                rows += [len(tokens), int(len(tokens) >= 1 and tokens[-1] >= begin),
                         int(len(tokens) < 2 or tokens[-2] >= begin), -1 if latest is None else latest]
            ops.whisper_logits_rules(logits, masked, self.always, self._at_begin_ids, rows, self._op_ints)
            return masked
        return self.apply_python(logits, generated)

    def _buffer(self, logits: torch.Tensor) -> torch.Tensor:
        masked = self._masked
        if masked is None or masked.shape != logits.shape or masked.device != logits.device:
            masked = self._masked = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        return masked

    def apply_python(self, logits: torch.Tensor, generated: list[list[int]]) -> torch.Tensor:
        """``apply`` in torch ops (the reference the one-op rules are tested against)."""
        logits = self._buffer(logits).copy_(logits).index_fill_(1, self.always, float("-inf"))  # [R, V]
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
            latest = _last_timestamp(tokens, begin)
            if latest is not None:  # never decreasing; never repeating, except to close a pair
                last = latest if last_was and not penultimate_was else latest + 1
                logits[row, begin:last] = float("-inf")
            if not tokens:  # the first token is a timestamp, and an early one
                logits[row, :begin] = float("-inf")
                logits[row, begin + self.options.max_initial_timestamp_index + 1:] = float("-inf")
        # the timestamps' total probability against the likeliest text token's (the softmax
        # normalizer is the same on both sides, so the logits compare as the log-probabilities)
        for row in self._stamps_win(logits, begin):
            logits[row, :begin] = float("-inf")

    @staticmethod
    def _stamps_win(logits: torch.Tensor, begin: int) -> list[int]:
        """The rows where logsumexp(logits[row, begin:]) > max(logits[row, :begin]). That total lies
        between the best timestamp's logit and it plus log(timestamps): a row decided by that bound (most
        steps) needs no logsumexp; once a row is within reach, torch's totals decide, so every decision
        is the one torch.logsumexp gives (some 15 us a step fewer on one core)."""
        stamps = logits[:, begin:]  # [R, timestamps]
        best_stamp, best_text = stamps.amax(dim=-1).tolist(), logits[:, :begin].amax(dim=-1).tolist()  # [R] each
        reach = math.log(stamps.shape[1]) + 1e-3  # (float32 roundings of the sum: far below 1e-3)
        mass = None  # torch's totals, computed once a row is within reach
        wins = []
        for row, (stamp, text) in enumerate(zip(best_stamp, best_text)):
            if stamp == float("-inf"):
                continue  # no timestamp allowed: a total of -inf wins nothing
            if stamp > text:
                wins.append(row)  # the total is at least its largest term
            elif stamp + reach + 1e-4 * abs(stamp) >= text:
                mass = torch.logsumexp(stamps, dim=-1).tolist() if mass is None else mass  # [R]
                if mass[row] > text:  # (float32 values compared as Python floats: the same order)
                    wins.append(row)
        return wins


def _last_timestamp(tokens: list[int], begin: int) -> int | None:
    """The last timestamp token of ``tokens`` (ids from ``begin`` on), or None: found from the end
    (a window's timestamps come every few tokens; a step no longer walks all its tokens)."""
    for token in reversed(tokens):
        if token >= begin:
            return token
    return None
