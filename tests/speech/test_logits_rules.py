"""Whisper's timestamp rule "the timestamps' total probability beats the best text token", decided
without torch.logsumexp where a bound decides it (speech/rules.py ``_stamps_win``): every decision
is the one torch.logsumexp gives, near ties included."""

from __future__ import annotations

import torch

from fastdecode.speech.rules import LogitsRules, _last_timestamp

BEGIN, VOCAB = 200, 260  # 60 timestamp tokens from 200


def torch_decision(logits: torch.Tensor) -> list[int]:
    """The rule as Whisper writes it."""
    wins = torch.logsumexp(logits[:, BEGIN:], dim=-1) > logits[:, :BEGIN].amax(dim=-1)
    return [row for row, win in enumerate(wins.tolist()) if win]


def test_decisions_equal_torch_logsumexp_near_ties_included():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(600, VOCAB, generator=generator) * 3
    text_best = logits[:, :BEGIN].amax(dim=-1)
    for row in range(600):
        kind = row % 6
        if kind == 0:  # the best stamp within reach of the best text: the total decides
            logits[row, BEGIN:] += text_best[row] - logits[row, BEGIN:].max() - row % 50 / 10
        elif kind == 1:  # a total within a few float32 steps of the best text, either side
            stamps = logits[row, BEGIN:]
            shift = text_best[row] - torch.logsumexp(stamps, dim=0)
            logits[row, BEGIN:] = stamps + shift + (row % 7 - 3) * 1e-6
        elif kind == 2:
            logits[row, BEGIN:] = float("-inf")  # no timestamp allowed
        elif kind == 3:
            logits[row, :BEGIN] = float("-inf")  # no text allowed
        elif kind == 4:
            logits[row, BEGIN : BEGIN + row % 60] = float("-inf")  # earlier timestamps ruled out
    expected = torch_decision(logits)
    assert 0 < len(expected) < 600
    assert LogitsRules._stamps_win(logits, BEGIN) == expected
    near = [row for row in range(600) if row % 6 == 1]  # the ties: both answers occur
    assert any(row in expected for row in near) and any(row not in expected for row in near)


def test_last_timestamp_from_the_end():
    assert _last_timestamp([], BEGIN) is None
    assert _last_timestamp([5, 6], BEGIN) is None
    assert _last_timestamp([BEGIN + 3, 7, BEGIN + 9, BEGIN + 9, 8], BEGIN) == BEGIN + 9
