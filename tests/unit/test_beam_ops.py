"""The C++ ops of encoder-decoder beam search against the PyTorch paths they replace:

- ``beam_candidates`` (layers/beam_search.cpp): log-softmax + suppressed tokens (in every row, and each
  beam's own: no-repeat-n-gram blocking) + running scores + per-sample top-k in one pass == the PyTorch
  beam step below (scores within float32 roundings, the same candidates in the same order), a sample's
  result bitwise the same alone;
- ``cross_attention`` (layers/cross_attention.cpp): each row's queries over its own source's first
  ``length`` keys == SDPA under the padding mask, head dims with and without a 16-wide tail, folded
  (strided) queries, a row bitwise the same alone; float16 keys and values == the op on their
  float32 values, bitwise;
- a whole beam search (tiny BART and T5, padded sources, min_new_tokens suppressing EOS, with and without
  (encoder) no-repeat-n-gram blocking) gives the same tokens and scores with the ops as without them; with
  ``beam_update`` as without it, and with the samples' candidates chosen in one call as each alone, bitwise.
"""

from __future__ import annotations

import pytest
import torch
from tiny_encdec import VOCAB, build, single_thread  # noqa: F401 (autouse fixture)

import fastdecode
from fastdecode.engine import beam_group
from fastdecode.engine import beam_scores as beam_module  # the beam policy of the engine's groups
from fastdecode.engine.cross import EncodedSources, source_lengths
from fastdecode.layers import ops
from fastdecode.layers.attention import attention
from fastdecode.models.seq2seq import padding_bias

NEG = beam_module.NEG
needs_kernels = pytest.mark.skipif(not ops.available(), reason="no AVX2 extension: PyTorch paths run")


def torch_candidates(logits, running, banned, keep):
    """A PyTorch beam step: log_softmax, suppression, + running, top-k per sample."""
    B, K = running.shape
    V = logits.shape[-1]
    logp = torch.log_softmax(logits, dim=-1)
    logp[:, banned] = float("-inf")
    return torch.topk((logp.view(B, K, V) + running[:, :, None]).view(B, K * V), keep)


@needs_kernels
@pytest.mark.parametrize("V, banned", [(1003, [2]), (160, []), (4099, [0, 7, 4098])])
@pytest.mark.parametrize("first_step", [True, False])
def test_beam_candidates_match_torch(V, banned, first_step):
    g = torch.Generator().manual_seed(V)
    B, K = 3, 4
    logits = torch.randn(B * K, V, generator=g) * 4
    running = torch.randn(B, K, generator=g) * 3
    if first_step:  # one real beam per sample, the others NEG (beam.py's start)
        running[:, 1:] = NEG
    banned = torch.tensor(banned, dtype=torch.long)
    keep = 2 * K
    scores, indices = ops.beam_candidates(logits, running.reshape(-1).contiguous(), banned, K, keep)
    expected = torch_candidates(logits, running, banned, keep)
    assert torch.equal(indices, expected.indices)
    torch.testing.assert_close(scores, expected.values, atol=1e-5, rtol=0)
    for b in range(B):  # a sample alone: bitwise the same
        alone = ops.beam_candidates(logits[b * K : (b + 1) * K].contiguous(), running[b].contiguous(), banned, K, keep)
        assert torch.equal(alone[0], scores[b : b + 1]) and torch.equal(alone[1], indices[b : b + 1])
    for _ in range(3):  # samples split over two threads (the kernel pool): the same bits
        split = ops.beam_candidates(logits, running.reshape(-1).contiguous(), banned, K, keep, 2)
        assert torch.equal(split[0], scores) and torch.equal(split[1], indices)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_beam_candidates_row_bans_match_torch(threads):
    """Each beam's own banned ids (no-repeat-n-gram blocking: a few per row, V where none, repeats, one also in
    the common list) score -inf in that row only: the PyTorch step with the same bans, a sample bitwise the
    same alone."""
    g = torch.Generator().manual_seed(5)
    B, K, V = 3, 4, 1003
    logits = torch.randn(B * K, V, generator=g) * 4
    running = torch.randn(B, K, generator=g) * 3
    common = torch.tensor([2], dtype=torch.long)
    top = logits.argmax(dim=-1)  # each row's best token: banning it changes the answer
    row_bans = torch.full((B * K, 3), V, dtype=torch.long)  # [B*K, W]
    row_bans[:, 0] = top
    row_bans[::2, 1] = top[::2]  # a repeat
    row_bans[1::3, 2] = 2  # also banned in every row
    keep = 2 * K
    scores, indices = ops.beam_candidates(logits, running.reshape(-1).contiguous(), common, K, keep, threads, row_bans)
    logp = torch.log_softmax(logits, dim=-1)
    logp[:, common] = float("-inf")
    for row in range(B * K):
        logp[row, [int(i) for i in row_bans[row] if i < V]] = float("-inf")
    expected = torch.topk((logp.view(B, K, V) + running[:, :, None]).view(B, K * V), keep)
    assert torch.equal(indices, expected.indices)
    torch.testing.assert_close(scores, expected.values, atol=1e-5, rtol=0)
    assert not any(int(i) % V == int(top[int(i) // V + b * K]) for b in range(B) for i in indices[b])
    for b in range(B):
        rows = slice(b * K, (b + 1) * K)
        alone = ops.beam_candidates(logits[rows].contiguous(), running[b].contiguous(), common, K, keep, 1,
                                    row_bans[rows].contiguous())
        assert torch.equal(alone[0], scores[b : b + 1]) and torch.equal(alone[1], indices[b : b + 1])


@needs_kernels
def test_beam_candidates_keep_more_than_finite():
    """Fewer finite scores than ``keep`` (a tiny vocabulary mostly banned): the finite ones first,
    best first, then -inf entries."""
    logits = torch.randn(1, 5, generator=torch.Generator().manual_seed(1)).repeat(2, 1)  # beam 1 scores 1 lower
    banned = torch.tensor([0, 1, 2, 3], dtype=torch.long)
    scores, indices = ops.beam_candidates(logits, torch.tensor([0.0, -1.0]), banned, 2, 4)
    assert indices[0, :2].tolist() == [4, 9] and torch.isinf(scores[0, 2:]).all()


@needs_kernels
def test_beam_candidates_rejects_bad_input():
    op = ops.beam_candidates
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        op(torch.zeros(4, 10), torch.zeros(4), torch.tensor([10]), 2, 2)
    with pytest.raises(RuntimeError, match="multiple of the beams"):
        op(torch.zeros(3, 10), torch.zeros(3), torch.tensor([], dtype=torch.long), 2, 2)
    with pytest.raises(RuntimeError, match="row_banned token id 11 outside"):
        op(torch.zeros(4, 10), torch.zeros(4), torch.tensor([], dtype=torch.long), 2, 2, 1, torch.full((4, 2), 11))


@needs_kernels
@pytest.mark.parametrize("D", [64, 24, 8])
def test_cross_attention_matches_sdpa(D):
    g = torch.Generator().manual_seed(D)
    B, H, fold, S = 3, 4, 4, 37
    lengths = torch.tensor([37, 1, 20])
    valid = torch.arange(S)[None, :] < lengths[:, None]  # [B, S] right-padded
    keys = torch.randn(B, H, S, D, generator=g)
    values = torch.randn(B, H, S, D, generator=g)
    flat = torch.randn(1, H, B * fold, D, generator=g)  # a flat step's queries, beams side by side
    q = flat[0].unflatten(1, (B, fold)).transpose(0, 1)  # [B, H, fold, D], strided, as a folded group's queries are
    out = ops.cross_attention(q, keys, values, source_lengths(valid), 0.3)
    expected = attention(q, keys, values, padding_bias(valid, torch.float32), 0.3, threads=1)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for b in range(B):  # a row alone: bitwise the same
        alone = ops.cross_attention(q[b : b + 1], keys[b : b + 1], values[b : b + 1], lengths[b : b + 1], 0.3)
        assert torch.equal(alone, out[b : b + 1])
    for threads in (2, 3):  # the (row, head) items split between threads (parallel.h): bitwise the same
        assert torch.equal(ops.cross_attention(q, keys, values, lengths, 0.3, threads), out)


@needs_kernels
@pytest.mark.parametrize("D", [64, 24])
def test_cross_attention_float16_keys_compute_on_their_float32_values(D):
    """float16 keys and values (a Whisper int8 model's cross K/V) are widened as they load: bitwise
    the op on their float32 values, strided queries and a 16-wide tail included."""
    g = torch.Generator().manual_seed(D)
    B, H, fold, S = 2, 3, 5, 29
    lengths = torch.tensor([29, 11])
    keys = torch.randn(B, H, S, D, generator=g).half()
    values = torch.randn(B, H, S, D, generator=g).half()
    q = torch.randn(1, H, B * fold, D, generator=g)[0].unflatten(1, (B, fold)).transpose(0, 1)  # [B, H, fold, D]
    out = ops.cross_attention(q, keys, values, lengths, 0.3)
    assert out.dtype == torch.float32
    assert torch.equal(out, ops.cross_attention(q, keys.float(), values.float(), lengths, 0.3))
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        ops.cross_attention(q, keys, values.float(), lengths, 0.3)


def test_source_lengths_only_for_right_padding():
    assert source_lengths(torch.tensor([[True, True, False], [True, False, False]])).tolist() == [2, 1]
    assert source_lengths(torch.tensor([[False, True, True]])) is None  # left padding: the mask path
    assert source_lengths(torch.tensor([[False, False]])) is None  # an empty row


@pytest.fixture(scope="module", params=["bart", "t5"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param).save_pretrained(folder)
    return fastdecode.load(str(folder))


def beam_results(gen, lengths: tuple[int, ...], seed: int, **options) -> tuple[list, list]:
    """(tokens, scores) of every hypothesis a beam search returns over random sources of these lengths."""
    g = torch.Generator().manual_seed(seed)
    sources = [torch.randint(3, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]
    results = gen.generate_ids_with_details(sources, **options)
    return [r.tokens for r in results], [r.score for r in results]


@needs_kernels
@pytest.mark.parametrize("ngrams", [{}, {"no_repeat_ngram_size": 2}, {"encoder_no_repeat_ngram_size": 2}])
def test_beam_search_same_with_and_without_ops(tiny, monkeypatch, ngrams):
    options = dict(num_beams=3, max_new_tokens=6, min_new_tokens=3, num_return_sequences=2, **ngrams)
    with_ops = beam_results(tiny, (9, 4, 13), 3, **options)
    monkeypatch.setattr(beam_module, "beam_candidates_op", lambda: None)
    monkeypatch.setattr(beam_module, "beam_update_op", lambda: None)
    monkeypatch.setattr(EncodedSources, "attend", lambda self, index, q, scale, threads: attention(
        q, self.keys[index], self.values[index], self.bias, scale, threads=threads))
    without = beam_results(tiny, (9, 4, 13), 3, **options)
    assert with_ops[0] == without[0]
    torch.testing.assert_close(torch.tensor(with_ops[1]), torch.tensor(without[1]), atol=1e-5, rtol=0)


@needs_kernels
@pytest.mark.parametrize("options", [{"no_repeat_ngram_size": 2, "length_penalty": 2.0},
                                     {"early_stopping": True, "length_penalty": 0.6}])
def test_beam_search_same_with_and_without_the_update_op(tiny, monkeypatch, options):
    """``beam_update`` (tests/unit/test_beam_update.py) against the tensor ops it replaces: the same bits."""
    options = dict(num_beams=3, max_new_tokens=6, min_new_tokens=2, num_return_sequences=2, **options)
    with_op = beam_results(tiny, (9, 4, 13), 5, **options)
    monkeypatch.setattr(beam_module, "beam_update_op", lambda: None)
    assert beam_results(tiny, (9, 4, 13), 5, **options) == with_op


@needs_kernels
@pytest.mark.parametrize("options", [{"no_repeat_ngram_size": 2}, {"min_new_tokens": 4}])
def test_beam_searches_sharing_a_candidates_call_keep_their_bits(tiny, monkeypatch, options):
    """Several samples' beam steps choose their candidates in one call of the op (``shared_candidates``, their
    bans padded to one width): the tokens and scores of each search as when each chose its own."""
    options = dict(num_beams=3, max_new_tokens=7, num_return_sequences=3, **options)
    shared = []

    def counted(searches, logits):
        answer = beam_module.shared_candidates(searches, logits)
        shared.append(answer is not None)
        return answer

    monkeypatch.setattr(beam_group, "shared_candidates", counted)
    together = beam_results(tiny, (9, 4, 13, 6), 7, **options)
    assert any(shared)  # the steps with several searches' beams shared
    monkeypatch.setattr(beam_group, "shared_candidates", lambda searches, logits: None)
    assert beam_results(tiny, (9, 4, 13, 6), 7, **options) == together


@needs_kernels
@pytest.mark.parametrize("T", [1, 2, 9, 40])
def test_cross_attention_float16_keys_widened_once_for_many_queries(T):
    """Several queries (a prompt's rows, a window's beams) read float16 keys widened once per eight keys into
    float32 (cross_attention.cpp's head_scores), one query widens them as it loads: every count gives the
    bits of the op on the keys' float32 values, a tail of keys past the last eight included."""
    g = torch.Generator().manual_seed(T)
    B, H, S, D = 2, 3, 53, 64
    lengths = torch.tensor([53, 20])
    keys = torch.randn(B, H, S, D, generator=g).half()
    values = torch.randn(B, H, S, D, generator=g).half()
    q = torch.randn(B, H, T, D, generator=g)
    out = ops.cross_attention(q, keys, values, lengths, 0.125)
    assert torch.equal(out, ops.cross_attention(q, keys.float(), values.float(), lengths, 0.125))
    for t in range(T):  # each query alone: the same bits
        assert torch.equal(ops.cross_attention(q[:, :, t : t + 1], keys, values, lengths, 0.125), out[:, :, t : t + 1])
