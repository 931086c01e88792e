"""No-repeat-n-gram blocking: the vectorized kernel against a plain-Python reference and transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastdecode.decoding.ngram_table import NgramTable
from fastdecode.decoding.processors import PAD, ban_mask, encoder_no_repeat_ngram_mask, no_repeat_ngram_mask
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


# NgramTable (decoding/ngram_table.py): the CPU path, kept incrementally, against the tensor kernel.

def table_mask(table: NgramTable, vocab_size: int) -> torch.Tensor:
    return ban_mask(table.ids(vocab_size), vocab_size)


@settings(max_examples=150, deadline=None)
@given(rows=histories, n=st.integers(1, 5),
       steps=st.lists(st.tuples(st.lists(st.integers(0, V - 1), min_size=5, max_size=5),
                                st.lists(st.integers(0, 4), min_size=5, max_size=5)), max_size=8))
def test_table_matches_the_tensor_kernel_through_records_and_reorders(rows, n, steps):
    """Random histories of any length (shorter than n included), beams reordered (a row taken twice, rows
    dropped) and tokens appended: the same bans as the tensor kernel on the same histories at every step."""
    table, plain = NgramTable(rows, n), [list(row) for row in rows]
    assert torch.equal(table_mask(table, V), no_repeat_ngram_mask(pad_rows(plain, torch.device("cpu")), n, V))
    for tokens, order in steps:
        order = [row % len(plain) for row in order[:len(plain)]]
        table.select_rows(order)
        plain = [list(plain[row]) for row in order]
        table.record(tokens[:len(plain)])
        plain = [history + [token] for history, token in zip(plain, tokens)]
        expected = no_repeat_ngram_mask(pad_rows(plain, torch.device("cpu")), n, V)
        assert torch.equal(table_mask(table, V), expected), (plain, n)
        assert [set(ids) for ids in table.banned()] == [reference_bans(history, n) for history in plain]


def test_table_rows_taken_twice_grow_apart():
    table = NgramTable([[1, 2, 3, 1, 2]], 3)
    assert table.banned() == [(3,)]
    table.select_rows([0, 0])
    table.record([4, 5])  # row 0: 1 2 3 1 2 4, row 1: 1 2 3 1 2 5
    table.record([1, 1])
    table.record([2, 2])
    assert [sorted(ids) for ids in table.banned()] == [[3, 4], [3, 5]]
    assert table.ids(V).tolist() == [[3, 4], [3, 5]]


def test_table_bans_nothing_until_a_row_holds_an_n_gram():
    table = NgramTable([[], [6]], 3)
    assert table.ids(V).tolist() == [[V], [V]]
    table.record([6, 6])
    table.record([6, 6])
    assert table.banned() == [(), (6,)]


@pytest.mark.parametrize("strategy", [{"do_sample": False}, {"do_sample": True, "seed": 3, "top_k": 3}])
def test_selector_on_the_cpu_takes_the_table_with_the_bans_of_the_tensor_kernel(strategy):
    """Greedy and sampling run the same processor: TokenSelector keeps an NgramTable on the CPU, and its
    processed logits equal those of the tensor kernel on the history."""
    from fastdecode.config import GenerationConfig
    from fastdecode.decoding.sampling import TokenSelector

    config = GenerationConfig(no_repeat_ngram_size=2, max_new_tokens=8, **strategy)
    selector = TokenSelector(config, [0], V, torch.device("cpu"))
    prompts = [[1, 2, 1], [3], [2, 2, 2, 2]]
    selector.start(prompts, torch.device("cpu"))
    assert selector.ngrams is not None and selector.history is None
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    expected = logits.masked_fill(no_repeat_ngram_mask(pad_rows(prompts, torch.device("cpu")), 2, V), float("-inf"))
    assert torch.equal(selector.process(logits, 1), expected)
    common, per_row = selector.bans_only(1, V)
    assert common.tolist() == []  # min_new_tokens 0: EOS not suppressed
    assert torch.equal(ban_mask(per_row, V), no_repeat_ngram_mask(pad_rows(prompts, torch.device("cpu")), 2, V))
