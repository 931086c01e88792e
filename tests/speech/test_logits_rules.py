"""Whisper's timestamp rule "the timestamps' total probability beats the best text token", decided
without torch.logsumexp where a bound decides it (speech/rules.py ``_stamps_win``): every decision
is the one torch.logsumexp gives, near ties included."""

from __future__ import annotations

import pytest
import torch

from fastdecode.layers import ops
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


def _rules(timestamps: bool) -> LogitsRules:
    from fastdecode.speech.search import SearchOptions
    from fastdecode.speech.vocabulary import WhisperVocabulary

    vocab = WhisperVocabulary(tokenizer=None, vocab_size=VOCAB, eot=195, sot=196, transcribe=197, translate=194,
                              sot_prev=193, sot_lm=None, no_timestamps=BEGIN - 1, no_speech=192, languages={})
    options = SearchOptions(timestamps=timestamps, suppress_tokens=(5, 17, 250), suppress_at_begin=(3, 195),
                            max_initial_timestamp_index=7)
    return LogitsRules(vocab, options, VOCAB, torch.device("cpu"))


def _generated(kind: int, generator: torch.Generator) -> list[int]:
    """A row's generated tokens: none, text only, a closed pair then text, an open timestamp, a closed pair."""
    text = torch.randint(0, 190, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator).tolist()
    stamp = BEGIN + int(torch.randint(0, 50, (1,), generator=generator))
    return [[], text, [stamp, stamp + 3, *text], [*text, stamp], [*text, stamp, stamp + 2]][kind % 5]


@pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")
@pytest.mark.parametrize("timestamps", [True, False])
def test_one_op_rules_equal_the_torch_rules(timestamps):
    """The one-op rules (whisper_rules.cpp) against ``apply_python``: the same masked logits, bit for bit, over
    rows at every kind of position (first token, text, open and closed timestamp pairs), near ties of the
    timestamps' total against the best text token both ways, rows where no timestamp or no text is allowed,
    strided rows, 1 to 6 rows."""
    generator = torch.Generator().manual_seed(int(timestamps))
    rules, reference = _rules(timestamps), _rules(timestamps)
    decided = set()
    for case in range(240):
        R = 1 + case % 6
        generated = [_generated(case + row, generator) for row in range(R)]
        logits = torch.randn(R, VOCAB + 3, generator=generator)[:, :VOCAB] * 3  # rows VOCAB + 3 apart
        for row, tokens in enumerate(generated):
            if case % 4 == 1 and tokens and tokens[-1] < BEGIN:  # the timestamps' total near the best text token
                stamps = logits[row, BEGIN:]
                shift = logits[row, :BEGIN].amax() - torch.logsumexp(stamps, dim=0)
                logits[row, BEGIN:] = stamps + shift + (case % 7 - 3) * 1e-6
            elif case % 4 == 2:
                logits[row, BEGIN:] -= row  # the best stamp within reach of the best text
        expected = reference.apply_python(logits, generated).clone()
        got = rules.apply(logits, generated)
        assert torch.equal(got, expected), (case, generated)
        decided.update((row, bool(torch.isinf(expected[row, :BEGIN]).all())) for row in range(R))
    if timestamps:  # both decisions were taken
        assert {won for _, won in decided} == {True, False}


@pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")
def test_one_op_rules_on_nan_logits_decide_as_torch():
    rules = _rules(True)
    logits = torch.randn(3, VOCAB)
    logits[0, 10] = float("nan")  # a NaN among the text tokens
    logits[1, BEGIN + 20] = float("nan")  # among the timestamps
    generated = [[1, 2], [1, 2], [1, 2]]
    expected = rules.apply_python(logits, generated).clone()
    torch.testing.assert_close(rules.apply(logits, generated), expected, rtol=0, atol=0, equal_nan=True)
