"""Sampling, processors, EOS, min/max lengths and stop strings, against transformers where it defines them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastdecode
from fastdecode.decoding.processors import apply_repetition_penalty, apply_top_k, apply_top_p
from fastdecode.decoding.stopping import StopStringMatcher
from tiny_models import VOCAB, build

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_and_gen():
    hf = build("llama-gqa", seed=5)
    return hf, fastdecode.from_hf(hf)


def _hf_generate(hf, ids, **options):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **options)
    return out[0, len(ids):].tolist()


def test_top_k_matches_transformers():
    logits = torch.randn(4, VOCAB)
    logits[0, :5] = 3.0  # ties at the k-th value are kept, as transformers does
    for k in (1, 3, 50):
        expected = transformers.TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(apply_top_k(logits, k), expected)


def test_top_p_matches_transformers():
    """The CPU's cut on the sorted values alone, and torch's sort where a tie straddles the cut (a row of
    equal logits; a pair of equal logits at the cut), equal transformers' warper bit for bit; rows
    already cut by top-k (-inf) too."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator) * 3
    logits[1] = 0.5  # every token tied: the cut falls inside the tie
    logits[2, :2] = logits[2].max() + 1.0  # the two most likely tied
    logits[3] = apply_top_k(logits[3:4], 20)[0]  # -inf below the 20th
    logits[4, :40] = torch.randn(40, generator=generator).round()  # many ties among the likely ones
    for p in (0.1, 0.5, 0.9, 0.999):
        expected = transformers.TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(apply_top_p(logits, p), expected)
        for row in range(logits.shape[0]):  # a row alone: the same cut
            assert torch.equal(apply_top_p(logits[row : row + 1], p), expected[row : row + 1])


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(2, VOCAB)
    history = torch.tensor([[3, 7, 7, 9], [1, 2, 150, 4]])
    seen = torch.zeros(2, VOCAB, dtype=torch.bool)
    seen.scatter_(1, history, True)
    expected = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.3)(history, logits.clone())
    assert torch.allclose(apply_repetition_penalty(logits, seen, 1.3), expected)


def test_greedy_with_repetition_penalty_equals_transformers(hf_and_gen):
    hf, gen = hf_and_gen
    prompt = [5, 9, 14, 20, 3]
    ours = gen.generate_ids([prompt], max_new_tokens=24, repetition_penalty=1.5)[0]
    assert ours == _hf_generate(hf, prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                repetition_penalty=1.5)


def test_seeded_sampling_is_reproducible_and_seed_dependent(hf_and_gen):
    _, gen = hf_and_gen
    options = dict(do_sample=True, temperature=1.3, top_p=0.95, max_new_tokens=20)
    a = gen.generate_ids([[4, 5, 6]], seed=11, **options)
    assert a == gen.generate_ids([[4, 5, 6]], seed=11, **options)
    assert a != gen.generate_ids([[4, 5, 6]], seed=12, **options)


def test_top_k_one_sampling_equals_greedy(hf_and_gen):
    _, gen = hf_and_gen
    prompt = [7, 8, 9, 10]
    greedy = gen.generate_ids([prompt], max_new_tokens=20)
    assert gen.generate_ids([prompt], max_new_tokens=20, do_sample=True, top_k=1, seed=0) == greedy
    assert gen.generate_ids([prompt], max_new_tokens=20, do_sample=True, temperature=0.0) == greedy


def test_num_return_sequences_layout(hf_and_gen):
    _, gen = hf_and_gen
    out = gen.generate_ids([[4, 5], [6, 7, 8]], do_sample=True, num_return_sequences=3, seed=1, max_new_tokens=6)
    assert len(out) == 6 and all(len(o) == 6 for o in out)


def test_eos_stops_and_is_included(hf_and_gen):
    hf, gen = hf_and_gen
    prompt = [5, 9, 14]
    free = gen.generate_ids([prompt], max_new_tokens=16)[0]
    eos = free[5]
    cut = gen.generate_ids([prompt], max_new_tokens=16, eos_token_id=eos)[0]
    assert cut == free[: free.index(eos) + 1]
    several = gen.generate_ids([prompt], max_new_tokens=16, eos_token_id=[999 % VOCAB, eos])[0]
    assert several == cut
    reference = _hf_generate(hf, prompt, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert cut == reference[: len(cut)]


def test_min_new_tokens_suppresses_eos(hf_and_gen):
    hf, gen = hf_and_gen
    prompt = [5, 9, 14]
    free = gen.generate_ids([prompt], max_new_tokens=16)[0]
    eos = free[1]
    ours = gen.generate_ids([prompt], max_new_tokens=16, min_new_tokens=6, eos_token_id=eos)[0]
    assert len(ours) >= 6 and eos not in ours[:5]
    reference = _hf_generate(hf, prompt, max_new_tokens=16, min_new_tokens=6, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    assert ours == reference[: len(ours)]


def test_finished_rows_leave_the_batch(hf_and_gen):
    """A row that hits EOS early stops; the others continue exactly as alone."""
    _, gen = hf_and_gen
    prompts = [[5, 9, 14], [20, 21, 22, 23, 24], [30]]
    free = gen.generate_ids([prompts[0]], max_new_tokens=16)[0]
    eos = free[2]
    batched = gen.generate_ids(prompts, max_new_tokens=16, eos_token_id=eos)
    assert batched == [gen.generate_ids([p], max_new_tokens=16, eos_token_id=eos)[0] for p in prompts]
    assert len(batched[0]) == free.index(eos) + 1 <= 3


def test_max_new_tokens_zero(hf_and_gen):
    _, gen = hf_and_gen
    assert gen.generate_ids([[4, 5]], max_new_tokens=0) == [[]]


def test_stream_ids_equals_generate_ids(hf_and_gen):
    _, gen = hf_and_gen
    assert list(gen.stream_ids([4, 5, 6], max_new_tokens=12)) == gen.generate_ids([[4, 5, 6]], max_new_tokens=12)[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "ab", "ba", "c", "abc", " "]), max_size=12),
       st.lists(st.sampled_from(["ab", "bc", "cab", "b a", "abcab"]), min_size=1, max_size=3))
def test_stop_matcher_equals_cutting_the_text_where_a_stop_first_completes(pieces, stops):
    """Generation ends as soon as any stop string is complete (as transformers' StopStringCriteria);
    the text is cut where the earliest stop string found by then begins."""
    matcher = StopStringMatcher(stops)
    shown = "".join(matcher.feed(p) for p in pieces) + matcher.finish()
    expected, text = None, ""
    for piece in pieces:
        text += piece
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            expected = text[: min(hits)]
            break
    assert shown == (text if expected is None else expected)
    assert matcher.stopped == (expected is not None)
