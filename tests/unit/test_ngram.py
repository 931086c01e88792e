"""No-repeat-n-gram blocking: the vectorized kernel against a plain-Python reference and transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.decoding.processors import PAD, encoder_no_repeat_ngram_mask, no_repeat_ngram_mask
from fastdecode.decoding.sampling import pad_rows

V = 7


def reference_bans(history: list[int], n: int) -> set[int]:
    """transformers' rule in plain Python: every n-gram whose first n-1 tokens equal the last n-1."""
    if len(history) + 1 < n:
        return set()
    tail = tuple(history[len(history) - (n - 1):])
    return {history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i:i + n - 1]) == tail}


def reference_encoder_bans(source: list[int], history: list[int], n: int) -> set[int]:
    if len(history) < n - 1:
        return set()
    tail = tuple(history[len(history) - (n - 1):])
    return {source[i + n - 1] for i in range(len(source) - n + 1) if tuple(source[i:i + n - 1]) == tail}


histories = st.lists(st.lists(st.integers(0, V - 1), min_size=0, max_size=14), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(rows=histories, n=st.integers(1, 5))
def test_matches_plain_python_reference(rows, n):
    banned = no_repeat_ngram_mask(pad_rows(rows, torch.device("cpu")), n, V)
    for row, history in enumerate(rows):
        assert set(torch.nonzero(banned[row]).flatten().tolist()) == reference_bans(history, n), (history, n)


@settings(max_examples=100, deadline=None)
@given(sources=histories, rows=histories, n=st.integers(1, 5))
def test_encoder_bans_match_plain_python_reference(sources, rows, n):
    count = min(len(sources), len(rows))
    sources, rows = sources[:count], rows[:count]
    banned = encoder_no_repeat_ngram_mask(pad_rows(sources, torch.device("cpu")),
                                          pad_rows(rows, torch.device("cpu")), n, V)
    for row in range(count):
        expected = reference_encoder_bans(sources[row], rows[row], n)
        assert set(torch.nonzero(banned[row]).flatten().tolist()) == expected


def test_padding_never_matches():
    history = torch.tensor([[PAD, PAD, 3, 4, 3]])
    assert torch.nonzero(no_repeat_ngram_mask(history, 2, V)[0]).flatten().tolist() == [4]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_same_banned_tokens_as_transformers(n):
    pytest.importorskip("transformers")
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    generator = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 5, (6, 20), generator=generator)
    scores = torch.zeros(6, 5)
    theirs = torch.isinf(NoRepeatNGramLogitsProcessor(n)(ids, scores))
    assert torch.equal(no_repeat_ngram_mask(ids, n, 5), theirs)
