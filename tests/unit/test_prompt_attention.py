"""A prompt's attention in query chunks over the keys each chunk can see (layers/attention.py's
``QUERY_CHUNK`` / ``KEY_MULTIPLE``): the same bits as SDPA over every key under the whole mask (where this
machine's SDPA gives them: ``SDPA_IGNORES_HIDDEN_KEYS``), for a causal prompt, a padded batch, a sliding
window, a per-head position bias and prompts that do not fill their last chunk; the key counts it reads;
and masks that hide nothing run as one SDPA call.

From 2 threads the same SDPA calls run on the kernel pool (layers/prompt_attention.cpp): the bits of the
one-thread path for the same cases, whatever torch's own thread count; small products and one thread stay
on SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdecode.layers import attention as attention_module
from fastdecode.layers import ops
from fastdecode.layers.attention import KEY_MULTIPLE, QUERY_CHUNK, attention, position_mask


def sdpa_reference(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def operands(B, H, Hkv, T, S, D, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, D, generator=generator), torch.randn(B, Hkv, S, D, generator=generator),
            torch.randn(B, Hkv, S, D, generator=generator))


def prompt_distance(B, T, S, first=0):
    """Key minus query position [B, T, S] for prompts whose queries start at ``first``."""
    return (torch.arange(S)[None, None, :] - torch.arange(first, first + T)[None, :, None]).expand(B, T, S)


def _sdpa_ignores_hidden_keys() -> bool:
    """Whether SDPA gives queries the same bits over 256 keys as over 512 with the last 256 hidden. PyTorch's CPU
    flash kernel multiplies blocks of up to 512 keys with MKL's GEMMs, whose rounding may depend on the block's
    width: the same bits on the Intel Xeon (AVX-512) of the benchmarks; up to 3e-7 apart on AMD EPYC Zen 5."""
    q, k, v = operands(1, 1, 1, 256, 512, 64, seed=5)
    mask = position_mask(prompt_distance(1, 256, 512), None, None, torch.float32)  # keys 256.. hidden from all
    return torch.equal(sdpa_reference(q, k[:, :, :256], v[:, :, :256], mask[..., :256], 0.125),
                       sdpa_reference(q, k, v, mask, 0.125))


SDPA_IGNORES_HIDDEN_KEYS = _sdpa_ignores_hidden_keys()


def assert_sdpa_result(out, reference):
    """``out`` is SDPA's result over every key: bit for bit where SDPA_IGNORES_HIDDEN_KEYS, else to float32
    rounding (a last-place difference from the key blocks' widths; a wrong chunk's keys differ by ~1)."""
    if SDPA_IGNORES_HIDDEN_KEYS:
        assert torch.equal(out, reference)
    else:
        torch.testing.assert_close(out, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("T, S", [(512, 512), (600, 640), (257, 512), (1000, 1024)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_causal_prompt_gets_the_bits_of_sdpa_over_every_key(T, S, threads):
    torch.set_num_threads(threads)
    try:
        q, k, v = operands(1, 9, 3, T, S, 64)
        mask = position_mask(prompt_distance(1, T, S), None, None, torch.float32)
        out = attention(q, k, v, mask, 0.125, threads=threads)
        assert_sdpa_result(out, sdpa_reference(q, k, v, mask, 0.125))
    finally:
        torch.set_num_threads(1)


def test_the_chunks_read_the_keys_they_can_see_rounded_up():
    T = S = 1000
    mask = position_mask(prompt_distance(1, T, S), None, None, torch.float32)
    expected = [min(S, -(-min(T, start + QUERY_CHUNK) // KEY_MULTIPLE) * KEY_MULTIPLE)
                for start in range(0, T, QUERY_CHUNK)]
    assert attention_module._key_extents(mask) == expected == [256, 512, 768, 1000]


def test_a_padded_batch_a_window_and_a_position_bias_keep_their_bits():
    B, H, T, S, D = 2, 4, 520, 768, 32
    q, k, v = operands(B, H, H, T, S, D, seed=1)
    distance = prompt_distance(B, T, S).clone()
    distance[1, :, 700:] = 1  # the second row's last keys hidden (padding)
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    for window, bias in [(None, None), (300, None), (None, lambda d: slopes[None, :, None, None] * d[:, None])]:
        mask = position_mask(distance, window, bias, torch.float32)
        assert_sdpa_result(attention(q, k, v, mask, D**-0.5, threads=1), sdpa_reference(q, k, v, mask, D**-0.5))


def test_a_mask_that_hides_no_key_chunk_is_one_call(monkeypatch):
    T = S = 600
    q, k, v = operands(1, 2, 2, T, S, 16)
    mask = torch.zeros(1, 1, T, S)  # every key visible to every query
    assert attention_module._key_extents(mask) is None
    calls = []
    real = attention_module._sdpa
    monkeypatch.setattr(attention_module, "_sdpa", lambda *args: calls.append(args[0].shape) or real(*args))
    assert torch.equal(attention(q, k, v, mask, 0.25, threads=1), sdpa_reference(q, k, v, mask, 0.25))
    assert calls == [torch.Size([1, 2, T, 16])]


def pool_calls(monkeypatch) -> list:
    calls = []
    real = ops.prompt_attention
    monkeypatch.setattr(ops, "prompt_attention", lambda *args: calls.append(args[4]) or real(*args))
    return calls


@pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")
@pytest.mark.parametrize("B, H, Hkv, T, S, first", [(1, 9, 3, 512, 512, 0), (1, 9, 3, 257, 512, 255),
                                                     (2, 4, 2, 600, 640, 40), (1, 3, 1, 256, 400, 144)])
@pytest.mark.parametrize("torch_threads", [1, 2])
def test_the_pool_gives_the_one_thread_bits(monkeypatch, B, H, Hkv, T, S, first, torch_threads):
    q, k, v = operands(B, H, Hkv, T, S, 64)
    mask = position_mask(prompt_distance(B, T, S, first), None, None, torch.float32)
    alone = attention(q, k, v, mask, 0.125, threads=1)
    calls = pool_calls(monkeypatch)
    torch.set_num_threads(torch_threads)
    try:
        pooled = attention(q, k, v, mask, 0.125, threads=2)
    finally:
        torch.set_num_threads(1)
    assert calls and torch.equal(pooled, alone)
    assert pooled.shape == alone.shape and torch.equal(pooled.contiguous(), alone.contiguous())


@pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")
def test_the_pool_keeps_the_bits_of_a_padded_batch_a_window_and_a_position_bias(monkeypatch):
    B, H, T, S, D = 2, 4, 520, 768, 32
    q, k, v = operands(B, H, H, T, S, D, seed=1)
    distance = prompt_distance(B, T, S).clone()
    distance[1, :, 700:] = 1  # the second row's last keys hidden (padding)
    slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])
    calls = pool_calls(monkeypatch)
    for window, bias in [(None, None), (300, None), (None, lambda d: slopes[None, :, None, None] * d[:, None])]:
        mask = position_mask(distance, window, bias, torch.float32)
        assert torch.equal(attention(q, k, v, mask, D**-0.5, threads=2), attention(q, k, v, mask, D**-0.5, threads=1))
    assert len(calls) == 3


@pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")
def test_on_the_pool_every_key_visible_and_no_mask_run_as_one_chunk(monkeypatch):
    q, k, v = operands(1, 6, 2, 300, 300, 64, seed=2)
    calls = pool_calls(monkeypatch)
    for mask in (None, torch.zeros(1, 1, 300, 300)):
        assert torch.equal(attention(q, k, v, mask, 0.125, threads=2), attention(q, k, v, mask, 0.125, threads=1))
    assert calls == [[], []]


@pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")
def test_small_products_and_one_thread_stay_on_sdpa(monkeypatch):
    calls = pool_calls(monkeypatch)
    q, k, v = operands(1, 2, 2, 8, 64, 16)  # 16K multiply-adds
    mask = position_mask(prompt_distance(1, 8, 64, 56), None, None, torch.float32)
    attention(q, k, v, mask, 0.25, threads=2)
    q, k, v = operands(1, 9, 3, 512, 512, 64)
    attention(q, k, v, position_mask(prompt_distance(1, 512, 512), None, None, torch.float32), 0.125, threads=1)
    q, k, v = operands(16, 9, 3, 1, 2048, 64)  # decode rows over a gathered cache: 19M multiply-adds, 128K a call
    attention(q, k, v, position_mask(prompt_distance(16, 1, 2048, 2047), None, None, torch.float32), 0.125, threads=2)
    assert calls == []
    assert not attention_module._on_the_pool(q.double(), k.double(), v.double(), None, 2)


@pytest.mark.skipif(not ops.available(), reason="the compiled kernels are not available")
def test_rows_strided_in_their_last_dim_stay_on_sdpa(monkeypatch):
    """SDPA takes its math kernel there (its flash kernel reads rows as contiguous): so do 2 threads."""
    q, k, v = operands(1, 4, 2, 300, 300, 64, seed=3)
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # [1, 4, 300, 64], last dim 300 floats apart
    calls = pool_calls(monkeypatch)
    assert torch.equal(attention(q, k, v, None, 0.125, threads=2), attention(q, k, v, None, 0.125, threads=1))
    assert calls == []
    with pytest.raises(RuntimeError, match="contiguous in their last dim"):
        ops.prompt_attention(q, k, v, None, [], 256, 0.125, 2)
