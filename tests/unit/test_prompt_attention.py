"""Our attention kernel for float32 on the CPU (layers/prompt_attention.cpp, through layers/attention.py's
``attention``): the float64 result to float32 rounding, for causal and padded masks, grouped and one-per-head
KV heads, head dims 64, 128 and odd ones, query counts that fill no tile, a window and a per-head position bias;
and each row's bits its own: the same on 1 and 2 threads, alone or in a padded batch (left or right), the prompt
whole or in chunks against the keys before it (here and through a model's scoring in chunks), on AVX2 and
AVX-512. Other dtypes and rows strided in their last dim stay on SDPA (its query chunks: ``_key_extents``)."""

from __future__ import annotations

import pytest
import torch

from fastdecode.layers import attention as attention_module
from fastdecode.layers import ops
from fastdecode.layers.attention import KEY_MULTIPLE, QUERY_CHUNK, attention, build_attention_mask, position_mask

pytestmark = pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")


def float64_reference(q, k, v, mask, scale):
    G = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(G, dim=1) for t in (k, v))  # [B, H, S, D]
    scores = q.double() @ k.transpose(-1, -2) * scale  # [B, H, T, S]
    if mask is not None:
        scores = scores + mask.double()
    return scores.softmax(dim=-1) @ v  # [B, H, T, D]


def assert_near_float64(out, q, k, v, mask, scale):
    """float32 rounding of the scores, the exponentials and the sums of a few hundred keys: ~1e-6 of the outputs'
    size (a wrong key or a lost row is off by ~1e-1)."""
    torch.testing.assert_close(out.double(), float64_reference(q, k, v, mask, scale), rtol=0, atol=4e-6)


def operands(B, H, Hkv, T, S, D, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=generator), torch.randn(B, Hkv, S, D, generator=generator),
            torch.randn(B, Hkv, S, D, generator=generator))


def prompt_distance(B, T, S, first=0):
    """Key minus query position [B, T, S] for prompts whose queries start at ``first``."""
    return (torch.arange(S)[None, None, :] - torch.arange(first, first + T)[None, :, None]).expand(B, T, S)


def causal(B, T, S, first=None):
    return position_mask(prompt_distance(B, T, S, S - T if first is None else first), None, None, torch.float32)


def kernel_calls(monkeypatch) -> list:
    calls = []
    real = ops.prompt_attention
    monkeypatch.setattr(ops, "prompt_attention", lambda *args: calls.append(args[-1]) or real(*args))
    return calls


@pytest.mark.parametrize("H, Hkv, T, S, D", [(9, 3, 300, 300, 64), (4, 4, 77, 200, 128), (6, 1, 50, 50, 40),
                                             (2, 2, 33, 61, 5)])
def test_a_causal_prompt_gets_the_float64_result(monkeypatch, H, Hkv, T, S, D):
    q, k, v = operands(1, H, Hkv, T, S, D)
    mask = causal(1, T, S)
    calls = kernel_calls(monkeypatch)
    assert_near_float64(attention(q, k, v, mask, D**-0.5, threads=2), q, k, v, mask, D**-0.5)
    assert_near_float64(attention(q, k, v, None, D**-0.5, threads=2), q, k, v, None, D**-0.5)
    assert len(calls) == 2


def test_a_padded_batch_a_window_and_a_position_bias_get_the_float64_result():
    B, H, T, S, D = 2, 4, 130, 150, 32
    q, k, v = operands(B, H, H, T, S, D, seed=1)
    distance = prompt_distance(B, T, S, S - T).clone()
    distance[1, :, 140:] = 1  # the second row's last keys hidden (padding)
    distance[0, :, :7] = 1  # the first row's first keys hidden (left padding)
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    for window, bias in [(None, None), (40, None), (None, lambda d: slopes[None, :, None, None] * d[:, None])]:
        mask = position_mask(distance, window, bias, torch.float32)
        assert_near_float64(attention(q, k, v, mask, D**-0.5, threads=1), q, k, v, mask, D**-0.5)
    mask = position_mask(distance, 40, None, torch.float32)  # [B, 1, T, S]
    per_head = mask.expand(B, H, T, S)  # a mask per head, the same for each (stride 0)
    assert torch.equal(attention(q, k, v, mask, D**-0.5, threads=2), attention(q, k, v, per_head, D**-0.5, threads=2))


@pytest.mark.parametrize("torch_threads", [1, 2])
def test_one_and_two_threads_give_the_same_bits(torch_threads):
    q, k, v = operands(2, 9, 3, 200, 260, 64, seed=2)
    mask = causal(2, 200, 260)
    alone = attention(q, k, v, mask, 0.125, threads=1)
    torch.set_num_threads(torch_threads)
    try:
        assert torch.equal(attention(q, k, v, mask, 0.125, threads=2), alone)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("left", [True, False])
def test_a_row_gets_its_bits_alone_and_in_a_padded_batch(left):
    T, D, pad = 70, 64, 23
    q, k, v = operands(1, 6, 2, T, T, D, seed=3)
    alone = attention(q, k, v, causal(1, T, T), 0.125, threads=1)
    batch = list(operands(3, 6, 2, T + pad, T + pad, D, seed=4))  # 3 rows, the middle one this prompt padded
    slots = slice(pad, None) if left else slice(0, T)
    for x, mine in zip(batch, (q, k, v)):
        x[1, :, slots] = mine[0]
    key_valid = torch.ones(3, T + pad, dtype=torch.bool)
    key_valid[1] = torch.arange(T + pad) >= pad if left else torch.arange(T + pad) < T
    mask = build_attention_mask(key_valid, 0, T + pad, torch.float32)  # [3, 1, T + pad, T + pad]
    assert torch.equal(attention(*batch, mask, 0.125, threads=2)[1, :, slots], alone[0])


def test_a_prompt_in_chunks_gets_the_bits_of_the_whole():
    T, D = 150, 64
    q, k, v = operands(1, 9, 3, T, T, D, seed=5)
    whole = attention(q, k, v, causal(1, T, T), 0.125, threads=2)
    for start, end in [(0, 1), (1, 40), (40, 41), (41, 150)]:  # each chunk over the keys before it and its own
        chunk = attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], causal(1, end - start, end), 0.125,
                          threads=1)
        assert torch.equal(chunk, whole[:, :, start:end])


def test_a_model_scoring_in_chunks_gets_the_bits_of_the_whole_prompt(monkeypatch):
    pytest.importorskip("transformers")
    from tiny_models import VOCAB, build

    import fastdecode
    from fastdecode.engine.scoring import ScoringSequence

    torch.manual_seed(0)
    gen = fastdecode.from_hf(build("llama-gqa"))
    ids = torch.randint(2, VOCAB, (41,), generator=torch.Generator().manual_seed(6)).tolist()
    scored = []
    for limit in (64, 6):  # one chunk; chunks of 6, the last of 4
        monkeypatch.setattr(ScoringSequence, "chunk_limit", limit)
        engine = gen.engine(max_batch_tokens=64)
        sequence = engine.submit_scoring(ids, 0)
        while engine.has_work():
            engine.step()
        scored.append(sequence.logprobs)
    assert len(scored[0]) == 40 and scored[0] == scored[1]


def test_avx2_gives_the_avx512_bits():
    if not ops.set_avx512():
        pytest.skip("this CPU has no AVX-512")
    q, k, v = operands(1, 6, 2, 90, 120, 72, seed=7)  # 72 dims: the values' full and masked AVX-512 registers
    mask = causal(1, 90, 120)
    wide = attention(q, k, v, mask, 0.1, threads=2)
    try:
        ops.set_avx512(False)
        assert torch.equal(attention(q, k, v, mask, 0.1, threads=2), wide)
    finally:
        ops.set_avx512(True)


def test_a_row_that_sees_no_key_gets_zeros():
    q, k, v = operands(1, 2, 2, 4, 8, 16, seed=8)
    mask = causal(1, 4, 8)
    mask[0, 0, 2] = float("-inf")
    out = attention(q, k, v, mask, 0.25, threads=1)
    assert torch.equal(out[0, :, 2], torch.zeros(2, 16))
    assert_near_float64(out[:, :, [0, 1, 3]], q[:, :, [0, 1, 3]], k, v, mask[:, :, [0, 1, 3]], 0.25)


def test_small_products_run_on_one_thread_and_broadcast_masks_are_expanded(monkeypatch):
    calls = kernel_calls(monkeypatch)
    q, k, v = operands(1, 2, 2, 8, 64, 16)  # 16K multiply-adds
    attention(q, k, v, causal(1, 8, 64), 0.25, threads=2)
    q, k, v = operands(2, 4, 4, 30, 40, 16)
    padding = torch.zeros(2, 1, 1, 40)
    padding[1, ..., 30:] = float("-inf")
    assert_near_float64(attention(q, k, v, padding, 0.25, threads=2), q, k, v, padding, 0.25)
    assert calls == [1, 2]


def test_other_dtypes_and_strided_rows_stay_on_sdpa(monkeypatch):
    calls = kernel_calls(monkeypatch)
    q, k, v = operands(1, 4, 2, 300, 300, 64, seed=9)
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # [1, 4, 300, 64], last dim 300 floats apart
    torch.testing.assert_close(attention(strided, k, v, None, 0.125, threads=2), attention(q, k, v, None, 0.125,
                                                                                           threads=2))
    mask = causal(1, 300, 300)
    out = attention(q.double(), k.double(), v.double(), mask.double(), 0.125, threads=1)
    torch.testing.assert_close(out, float64_reference(q, k, v, mask, 0.125))
    assert calls == [2]
    with pytest.raises(RuntimeError, match="contiguous in their last dim"):
        ops.prompt_attention(strided, k, v, None, 0.125, 2)


def test_sdpa_chunks_read_the_keys_they_can_see_rounded_up():
    T = S = 1000
    mask = position_mask(prompt_distance(1, T, S), None, None, torch.float32)
    expected = [min(S, -(-min(T, start + QUERY_CHUNK) // KEY_MULTIPLE) * KEY_MULTIPLE)
                for start in range(0, T, QUERY_CHUNK)]
    assert attention_module._key_extents(mask) == expected == [256, 512, 768, 1000]
    assert attention_module._key_extents(torch.zeros(1, 1, T, S)) is None
