"""Compact K-quant scales (layers/kscales.py, kscales.h): Q4_K, Q5_K and Q6_K weights keep GGUF's sub-scale
codes and float16 super-scales, decoded in the kernels. Every op must give the bits it gives on the same
weight with float32 scales (the layout before), on the AVX2 and the AVX-512 kernels, at any row and thread
count, tiled and rows layouts, padded last tiles included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kernel_isas import on_both_isas, products_of_both  # noqa: E402
from kquant_gguf import random_blocks, write_tiny_llama  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.layers import kscales, ops  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight, dequantize, keeps_rows_layout, rows_layout, tiled  # noqa: E402
from fastdecode.loading.gguf_blocks import repack  # noqa: E402

needs_kernel = pytest.mark.skipif("not ops.available()", reason="no C++ kernels on this machine")
ROWS = (1, 2, 3, 5, 8, 9)

# (label, GGUF type, N, K, tiled): odd N pads the last tile (tiled) or leaves outputs to the AVX2 kernel (rows)
CASES = [("Q4_K tiled", QT.Q4_K, 24, 512, True), ("Q4_K tiled N=13", QT.Q4_K, 13, 256, True),
         ("Q5_K tiled N=21", QT.Q5_K, 21, 512, True), ("Q4_K rows", QT.Q4_K, 10, 512, False),
         ("Q6_K rows", QT.Q6_K, 24, 512, False), ("Q6_K rows N=13", QT.Q6_K, 13, 256, False),
         # several super-blocks per row and tile pairs (the AVX-512 kernels decode records once per super-block),
         # more outputs than one piece of 32 (rows6_avx512.cpp's six_compact_outputs), a tail of 2
         ("Q4_K tiled N=40 K=1536", QT.Q4_K, 40, 1536, True), ("Q6_K rows N=70 K=768", QT.Q6_K, 70, 768, False)]


def compact_and_float(qtype: QT, N: int, K: int, tile: bool) -> tuple[QuantizedWeight, QuantizedWeight]:
    """The repacked weight (compact scales) and the same weight with float32 scales and mins."""
    weight = repack(qtype.name, random_blocks(qtype, (N, K), seed=N + K), (N, K), tile=tile)
    assert kscales.is_compact(weight.scale) and weight.is_tiled == tile
    expanded = dataclasses.replace(weight, scale=kscales.expand(weight.scale, weight.group),
                                   mins=None if weight.mins is None else kscales.expand(weight.mins, weight.group))
    return weight, expanded


@needs_kernel
@pytest.mark.parametrize("label, qtype, N, K, tile", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("activation_bits", [8, 32])
def test_products_on_compact_scales_are_the_float32_scales_bits(label, qtype, N, K, tile, activation_bits):
    compact, expanded = compact_and_float(qtype, N, K, tile)
    for case, got, want in products_of_both(compact, expanded, K, ROWS, activation_bits):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), case


@needs_kernel
@pytest.mark.parametrize("label, qtype, N, K, tile", CASES, ids=[c[0] for c in CASES])
def test_exact_products_and_dequantization_are_the_float32_scales_bits(label, qtype, N, K, tile):
    compact, expanded = compact_and_float(qtype, N, K, tile)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    dense = dequantize(expanded)
    assert torch.equal(dequantize(compact), dense)
    rows = torch.tensor([N - 1, 0, N // 2])
    assert torch.equal(dequantize(compact, rows), dense[rows])  # embedding lookups
    for w in (compact, expanded):
        assert torch.equal(ops.dequantize(w.codes, w.scale, w.mins, w.bits, w.group, 2, w.outputs), dense)
    def exact(w, threads):
        return on_both_isas(lambda: ops.exact_qmatmul(x, w.codes, w.scale, w.mins, w.bits, w.group, threads, w.outputs))

    def prompt(w):  # the int8 prompt GEMM of groups of 16 (layers/qprompt.cpp)
        return on_both_isas(lambda: ops.prompt_qmatmul(x, w.codes, w.scale, 2))

    for threads in (1, 2):
        assert all(torch.equal(g, w) for g, w in zip(exact(compact, threads), exact(expanded, threads), strict=True))
    if qtype == QT.Q6_K:
        assert all(torch.equal(g, w) for g, w in zip(prompt(compact), prompt(expanded), strict=True))


@pytest.mark.parametrize("qtype, N", [(QT.Q4_K, 16), (QT.Q4_K, 13), (QT.Q5_K, 5)], ids=lambda v: str(v))
def test_tiled_records_are_a_byte_shuffle_of_the_rows_records(qtype, N):
    """Repacking straight into tiles, tiling the rows layout, and reading rows back from tiles agree."""
    raw = random_blocks(qtype, (N, 512), seed=9)
    rows = repack(qtype.name, raw, (N, 512))
    direct, by_rows = repack(qtype.name, raw, (N, 512), tile=True), tiled(rows)
    for field in ("codes", "scale", "mins"):
        assert torch.equal(getattr(direct, field), getattr(by_rows, field)), field
    back = rows_layout(direct)
    assert torch.equal(back[1], rows.scale) and torch.equal(back[2], rows.mins)
    permuted = direct.take_rows(torch.arange(N - 1, -1, -1))
    assert torch.equal(dequantize(permuted), dequantize(rows).flip(0))


def test_compact_scales_take_what_the_issue_counts():
    """Q4_K: 4.5 bits per weight in the file, 4 + 0.625 held (float32 scale and mins: 4 + 2); Q6_K: 6 + 0.5625,
    the file's 6.5625 (its codes packed: layers/six_bit.py; 8 + 0.5625 as int8 codes)."""
    q4 = repack("Q4_K", random_blocks(QT.Q4_K, (16, 512), seed=1), (16, 512), tile=True)
    q6 = repack("Q6_K", random_blocks(QT.Q6_K, (16, 512), seed=1), (16, 512))
    assert q4.nbytes * 8 / (16 * 512) == 4 + 0.625
    assert q6.nbytes * 8 / (16 * 512) == 6 + 0.5625
    assert q4.shape == q6.shape == (16, 512)
    wide = repack("Q4_K", random_blocks(QT.Q4_K, (16, 512), seed=1), (16, 512), tile=True, compact=False)
    assert wide.scale.dtype == torch.float32 and wide.nbytes * 8 / (16 * 512) == 4 + 2
    assert torch.equal(wide.scale, kscales.expand(q4.scale, 32)) and torch.equal(wide.mins, kscales.expand(q4.mins, 32))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize("tied", [False, True])
def test_k_quant_products_and_a_q6_k_head_hold_compact_scales_and_tables_float32_ones(qtype, tied, tmp_path):
    """The K-quant matrices of products keep GGUF's sub-scale codes and float16 super-scales (layers/kscales.py);
    the embedding table float32 scales, tied or not; an untied LM head compact ones where it is Q6_K (its kernel
    decodes the records in registers: rows6_avx512.cpp), float32 ones otherwise (loading/gguf.py)."""
    weights = fastdecode.load(write_tiny_llama(tmp_path / "k.gguf", qtype, tied=tied)).checkpoint.weights
    held = {name: w for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    assert any(keeps_rows_layout(name) for name in held) and not all(keeps_rows_layout(name) for name in held)
    assert ("lm_head.weight" in held) and ("embed.weight" in held)
    for name, weight in held.items():
        compact = not keeps_rows_layout(name) or (name == "lm_head.weight" and qtype == QT.Q6_K and not tied)
        assert kscales.is_compact(weight.scale) == compact, name
        assert (weight.scale.dtype == torch.float32) != compact, name
