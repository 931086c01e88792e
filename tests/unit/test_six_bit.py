"""Packed 6-bit Q6_K codes (layers/six_bit.py, six_bit.h): every op on a weight holding GGUF's ql/qh bytes
gives the bits it gives on the same weight holding the unpacked int8 codes (the layout before): decode
products (int8 and float32 activations, 1-9 rows), the several-row paths, the prompt GEMM (AVX2, VNNI and
AMX), dequantization and row lookups, on the AVX2 and AVX-512 kernels, 1 and 2 threads, output counts
that leave a tail to each kernel's narrower path, compact and float32 / float16 scales."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402
from kernel_isas import on_both_isas, products_of_both  # noqa: E402
from kquant_gguf import random_blocks  # noqa: E402

from fastdecode.layers import kscales, ops, six_bit  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight, dequantize, has_prompt_kernel  # noqa: E402
from fastdecode.loading.gguf_blocks import repack  # noqa: E402

needs_kernel = pytest.mark.skipif("not ops.available()", reason="no C++ kernels on this machine")
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 17)
# N: 4-output AVX-512 steps and 32-output chunks with tails (13, 37), a 4-output piece of compact scales (K = 2304)
SHAPES = [(13, 256), (24, 512), (37, 768), (64, 2304)]


def packed_and_int8(N: int, K: int, seed: int, scales: str = "compact") -> tuple[QuantizedWeight, QuantizedWeight]:
    """A random Q6_K weight as loaded (packed 6-bit codes) and the same weight with int8 codes."""
    raw = random_blocks(QT.Q6_K, (N, K), seed=seed)
    packed = repack("Q6_K", raw, (N, K), compact=scales == "compact")
    if scales == "float16":
        packed = dataclasses.replace(packed, scale=packed.scale.half())
    assert packed.bits == 6 and packed.codes.shape == (N, K * 3 // 4) and not packed.is_tiled
    int8 = dataclasses.replace(packed, bits=8, codes=six_bit.unpack(packed.codes))
    return packed, int8


def test_unpacked_codes_are_gguf_dequantization_and_pack_inverts_them():
    N, K = 5, 512
    raw = random_blocks(QT.Q6_K, (N, K), seed=1)
    weight = repack("Q6_K", raw, (N, K))
    assert torch.equal(dequantize(weight), torch.from_numpy(quants.dequantize(raw, QT.Q6_K).reshape(N, K)))
    codes = six_bit.unpack(weight.codes)
    assert codes.dtype == torch.int8 and int(codes.min()) >= -32 and int(codes.max()) <= 31
    assert torch.equal(six_bit.pack(codes), weight.codes)
    rows = torch.tensor([4, 0, 2])
    assert torch.equal(dequantize(weight, rows), dequantize(weight)[rows])  # embedding lookups
    with pytest.raises(ValueError, match="256"):
        six_bit.pack(codes[:, :128])


def test_packed_weights_hold_three_quarters_of_the_codes_bytes():
    packed, int8 = packed_and_int8(16, 1024, seed=2)
    assert packed.codes.numel() * 4 == int8.codes.numel() * 3
    assert packed.nbytes < int8.nbytes and has_prompt_kernel(packed)


@needs_kernel
@pytest.mark.parametrize("N, K", SHAPES)
@pytest.mark.parametrize("activation_bits", [8, 32])
@pytest.mark.parametrize("scales", ["compact", "float32", "float16"])
def test_decode_products_are_the_int8_codes_bits(N, K, activation_bits, scales):
    packed, int8 = packed_and_int8(N, K, seed=N + K, scales=scales)
    for case, got, want in products_of_both(packed, int8, K, ROWS, activation_bits):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), case
        assert torch.equal(got[0], got[1]) or activation_bits == 32, case  # AVX-512 = AVX2 (int8)


@needs_kernel
@pytest.mark.parametrize("N, K", SHAPES)
def test_prompt_gemm_is_the_int8_codes_bits_on_every_kernel(N, K):
    packed, int8 = packed_and_int8(N, K, seed=7 * N + K, scales="float32")
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(9))
    has_amx = ops.set_amx()
    try:
        for amx in (True, False) if has_amx else (False,):
            ops.set_amx(amx)
            for M in (1, 3, 8, 16, 17, 40):  # below and from AMX's 8 rows, a part-filled 16-row tile
                for threads in (1, 2):
                    for b in (None, bias):
                        got = on_both_isas(lambda: ops.prompt_qmatmul(x[:M], packed.codes, packed.scale, threads, b))
                        want = on_both_isas(lambda: ops.prompt_qmatmul(x[:M], int8.codes, int8.scale, threads, b))
                        for g, w in zip(got, want, strict=True):
                            assert torch.equal(g, w), (amx, M, threads, b is None)
    finally:
        ops.set_amx(has_amx)


@needs_kernel
def test_compact_scales_reach_the_prompt_gemm_and_dequantization():
    packed, int8 = packed_and_int8(24, 512, seed=11)
    assert kscales.is_compact(packed.scale)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(12))
    assert torch.equal(ops.prompt_qmatmul(x, packed.codes, packed.scale, 2),
                       ops.prompt_qmatmul(x, int8.codes, int8.scale, 2))
    for threads in (1, 2):
        got = ops.dequantize(packed.codes, packed.scale, None, 6, 16, threads, packed.outputs)
        assert torch.equal(got, ops.dequantize(int8.codes, int8.scale, None, 8, 16, threads, int8.outputs))
        assert torch.equal(got, dequantize(packed))
    got = ops.exact_qmatmul(x, packed.codes, packed.scale, None, 6, 16, 2, packed.outputs)
    assert torch.equal(got, ops.exact_qmatmul(x, int8.codes, int8.scale, None, 8, 16, 2, int8.outputs))


@needs_kernel
def test_codes_that_do_not_fill_whole_records_are_named():
    packed, _ = packed_and_int8(8, 256, seed=13)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="6-bit codes"):
        ops.qmatmul(x, packed.codes[:, :100].contiguous(), packed.scale, None, 6, 16, 1)
    with pytest.raises(RuntimeError, match="codes"):
        ops.prompt_qmatmul(x, packed.codes[:, :100].contiguous(), packed.scale, 1)


def test_repacked_codes_are_the_files_bytes():
    N, K = 3, 512
    raw = random_blocks(QT.Q6_K, (N, K), seed=14)
    blocks = raw.reshape(N, K // 256, 210)
    packed = repack("Q6_K", raw, (N, K))
    assert np.array_equal(packed.codes.numpy().reshape(N, K // 256, 192), blocks[..., :192])
