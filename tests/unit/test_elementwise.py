"""The fused element-wise ops (layers/elementwise.cpp) against their PyTorch path (layers/elementwise.py),
and whole tiny models run on both paths: the kernels may differ only by float rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fastdecode
from fastdecode.cache.view import NoCache
from fastdecode.layers import elementwise
from fastdecode.layers.elementwise import elementwise_ops
from fastdecode.layers.positions import RotaryEmbedding, rope_inverse_frequencies, rotate_heads
from fastdecode.layers.products import KernelChoice, Products
from kernel_isas import avx512_gives_the_avx2_bits, needs_avx512
from tiny_models import VOCAB, build, build_gemma3


def generated_rows() -> Products:
    """Every row generated, on this thread's thread count."""
    return Products.generated(torch.get_num_threads(), kernels=KernelChoice())


needs_kernels = pytest.mark.skipif(elementwise_ops() is None, reason="the AVX2 extension is not available here")


def _close(a, b, atol=2e-6):
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("C", [64, 13])  # whole AVX vectors, and a scalar tail
def test_norms_match_pytorch(C):
    g = torch.Generator().manual_seed(0)
    x, delta = torch.randn(2, 3, C, generator=g), torch.randn(2, 3, C, generator=g) * 4
    w, dw = torch.randn(C, generator=g), torch.randn(C, generator=g)
    _close(elementwise.rms_norm(x, w, 1e-6), F.rms_norm(x, (C,), w, 1e-6))
    _close(elementwise.rms_norm(x.transpose(0, 1), None, 1e-5), F.rms_norm(x.transpose(0, 1), (C,), None, 1e-5))
    for post in (None, dw):  # plain residual add; Gemma's normed delta
        s, h = elementwise.add_rms_norm(x, delta, w, 1e-6, post)
        s_ref = x + (delta if post is None else F.rms_norm(delta, (C,), post, 1e-6))
        _close(s, s_ref)
        _close(h, F.rms_norm(s_ref, (C,), w, 1e-6))


@needs_kernels
@pytest.mark.parametrize("D, rotary_dim", [(64, 64), (16, 8), (8, 8), (40, 24)])  # full, partial, tails
@pytest.mark.parametrize("normed", [False, True])
def test_qkv_heads_match_rotate_heads(D, rotary_dim, normed):
    g = torch.Generator().manual_seed(1)
    B, T, H, Hkv = 2, 3, 4, 2
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)  # one fused product's output
    inv_freq, factor = rope_inverse_frequencies(rotary_dim, 10000.0, None, 128)
    cos, sin = RotaryEmbedding(rotary_dim, inv_freq, factor).tables(torch.tensor([[5, 6, 7], [0, 1, 90]]), torch.float32)
    weight = torch.randn(H + Hkv, D, generator=g) if normed else None
    q, k, v = elementwise.qkv_heads(qkv, H, Hkv, cos, sin, weight, 1e-6)
    heads = qkv.view(B, T, H + 2 * Hkv, D)  # [B, T, heads, D]
    qk = heads[:, :, : H + Hkv]  # [B, T, H + Hkv, D]
    if normed:
        qk = F.rms_norm(qk, (D,), None, 1e-6) * weight
    qk = rotate_heads(qk, cos, sin)
    assert torch.equal(v, heads[:, :, H + Hkv :].transpose(1, 2))
    for out, reference in ((q, qk[:, :, :H].transpose(1, 2)), (k, qk[:, :, H:].transpose(1, 2))):
        if normed:
            _close(out, reference)
        else:  # the same products and sums in the same order: bitwise
            assert torch.equal(out, reference)


@needs_kernels
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("I", [64, 21])
def test_gated_activation_matches_pytorch(activation, I):
    gate_up = torch.randn(3, 2 * I, generator=torch.Generator().manual_seed(2)) * 3
    reference = elementwise.ACTIVATIONS[activation](gate_up[:, :I]) * gate_up[:, I:]
    _close(elementwise.gated(gate_up, activation), reference)


def test_other_dtypes_and_activations_take_the_pytorch_path():
    x = torch.randn(2, 8, dtype=torch.float64)
    torch.testing.assert_close(elementwise.rms_norm(x, None, 1e-6), F.rms_norm(x, (8,), None, 1e-6))
    gate_up = torch.randn(2, 16)
    torch.testing.assert_close(elementwise.gated(gate_up, "relu"), F.relu(gate_up[:, :8]) * gate_up[:, 8:])


def _logits(gen, ids):
    with torch.inference_mode():
        return gen.model.forward(torch.tensor([ids]), torch.arange(len(ids))[None],
                                 NoCache.of_model(gen.model, generated_rows(), None, torch.arange(len(ids))[None]),
                                 all_logits=True)[0]  # [T, V]


@needs_kernels
@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_models_agree_on_both_paths(kind, monkeypatch):
    pytest.importorskip("transformers")
    gen = fastdecode.from_hf(build_gemma3() if kind == "gemma3" else build(kind))
    ids = torch.randint(2, VOCAB, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    fused_logits, fused_tokens = _logits(gen, ids), gen.generate_ids([ids], max_new_tokens=12)
    monkeypatch.setattr(elementwise, "elementwise_ops", lambda: None)
    torch.testing.assert_close(fused_logits, _logits(gen, ids), atol=1e-5, rtol=0)
    assert gen.generate_ids([ids], max_new_tokens=12) == fused_tokens


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}])
def test_rotary_tables_are_cos_sin_with_the_signed_sine(scaling):
    inv_freq, factor = rope_inverse_frequencies(32, 10000.0, scaling, 256)
    rope = RotaryEmbedding(32, inv_freq, factor)
    positions = torch.tensor([[0, 5, 100], [3, 4, 4000]])
    cos, sin = rope.cos_sin(positions, torch.float32)  # [B, 1, T, rot]
    table_cos, signed_sin = rope.tables(positions, torch.float32)  # [B, T, 1, rot]
    assert torch.equal(table_cos, cos.transpose(1, 2))
    assert torch.equal(signed_sin, torch.cat((-sin[..., :16], sin[..., 16:]), dim=-1).transpose(1, 2))


@needs_kernels
@pytest.mark.parametrize("threads", [2, 3])
def test_a_prompts_rows_split_over_threads_give_the_bits_of_one_thread(threads):
    """Big inputs (a prompt's rows: ``SPLIT_MIN_FLOATS``) split their rows over the forward's threads; every row
    is computed alone, so the results are those of one thread, bit for bit."""
    g = torch.Generator().manual_seed(3)
    B, T, C, H, Hkv, D = 1, 300, 576, 9, 3, 64
    x, delta = torch.randn(B, T, C, generator=g), torch.randn(B, T, C, generator=g)
    w, dw = torch.randn(C, generator=g), torch.randn(C, generator=g)
    assert x.numel() >= elementwise.SPLIT_MIN_FLOATS
    for post in (None, dw):
        one, split = elementwise.add_rms_norm(x, delta, w, 1e-6, post), elementwise.add_rms_norm(x, delta, w, 1e-6, post,
                                                                                                  threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(one, split))
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g)
    cos, sin = torch.randn(B, T, 1, D, generator=g), torch.randn(B, T, 1, D, generator=g)
    norm = torch.randn(H + Hkv, D, generator=g)
    for weight in (None, norm):
        one = elementwise.qkv_heads(qkv, H, Hkv, cos, sin, weight, 1e-6)
        split = elementwise.qkv_heads(qkv, H, Hkv, cos, sin, weight, 1e-6, threads=threads)
        assert all(torch.equal(a, b) for a, b in zip(one, split))
    gate_up = torch.randn(B, T, 2 * 1536, generator=g)
    for activation in ("silu", "gelu_pytorch_tanh"):
        assert torch.equal(elementwise.gated(gate_up, activation), elementwise.gated(gate_up, activation, threads=threads))


@needs_kernels
@needs_avx512
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_gives_the_avx2_bits_on_avx512(activation):
    """gated's AVX-512 loop (gated_avx512.cpp: 16 lanes, SLEEF's 16-lane functions) equals the AVX2 one bit for
    bit, NaNs included: inputs over the whole float range (random bit patterns: huge, tiny, subnormal, inf,
    NaN), a normal spread, widths with every tail (16-lane blocks, an 8-lane block, scalars)."""
    g = torch.Generator().manual_seed(4)
    patterns = torch.randint(-2**31, 2**31, (64, 2 * 1536), generator=g, dtype=torch.int64).to(torch.int32)
    spread = torch.randn(64, 2 * 1536, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    cases = [(rows[:, : 2 * I].contiguous(),) for rows in (patterns.view(torch.float32), spread)
             for I in (1536, 27, 19, 8)]
    avx512_gives_the_avx2_bits(lambda gate_up: elementwise.gated(gate_up, activation).view(torch.int32), cases)
