"""Many int8 rows x a tiled weight of 4-bit codes on the rows-in-lanes kernel (layers/qlanes_avx512.cpp: 16
rows per register, from 32 rows where the CPU has AVX-512 VNNI): bit for bit the tiled kernel's results.

Oracles: each row alone (one row: qtiles_avx512.cpp's pair kernel) and the AVX2 kernel on all the rows. Every
4-bit format the tiled layout holds (float16 scales, float16 scales + mins (Q4_1), compact K-quant scales + mins
(Q4_K), float32 scales (ours)); row counts straddling the threshold, the groups of 16 rows and the pairs of
groups; outputs straddling passes of 4 tiles and a partial tile; 1 and 2 threads; a bias; a row block edge."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT
from kquant_gguf import random_blocks

from fastdecode.layers import ops
from fastdecode.layers.quantized import QuantizedWeight, quantize_matrix
from fastdecode.loading.gguf_blocks import repack

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C++ kernels on this machine")
ROWS = (31, 32, 33, 47, 48, 63, 64, 65, 100)


def _four_bit_weights():
    for qtype, (N, K) in ((QT.Q4_0, (40, 256)), (QT.Q4_1, (13, 256)), (QT.Q4_1, (72, 576)), (QT.Q4_K, (72, 512))):
        weight = repack(qtype.name, random_blocks(qtype, (N, K), seed=N + K), (N, K), tile=True)
        assert weight.is_tiled and weight.bits == 4
        yield f"{qtype.name} N={N}", weight
    yield "int4 N=100", quantize_matrix(torch.randn(100, 256, generator=torch.Generator().manual_seed(8)), "int4")


FOUR_BIT = dict(_four_bit_weights())


def gemm(x: torch.Tensor, w: QuantizedWeight, threads: int = 1, bias: torch.Tensor | None = None) -> torch.Tensor:
    return ops.tiled_gemm(x, w.codes, w.scale, w.mins, w.bits, w.outputs, threads, bias)


def each_row_alone(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return torch.cat([ops.qmatmul(x[m:m + 1], w.codes, w.scale, w.mins, w.bits, w.group, 1, 8, w.outputs)
                      for m in range(x.shape[0])])


def on_avx2(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    wide = ops.set_avx512()
    try:
        ops.set_avx512(False)
        return gemm(x, w)
    finally:
        ops.set_avx512(wide)


@pytest.mark.parametrize("label", FOUR_BIT)
def test_many_rows_give_each_row_alone_and_the_avx2_bits_on_1_and_2_threads(label):
    w = FOUR_BIT[label]
    x = torch.randn(max(ROWS), w.inputs, generator=torch.Generator().manual_seed(1)) * 3
    alone = each_row_alone(x, w)
    assert torch.equal(on_avx2(x, w), alone), label
    for M in ROWS:
        assert torch.equal(gemm(x[:M], w), alone[:M]), (label, M)
        assert torch.equal(gemm(x[:M], w, threads=2), alone[:M]), (label, M)


@pytest.mark.parametrize("label", ["Q4_1 N=13", "Q4_K N=72", "int4 N=100"])
def test_a_bias_is_the_same_addition_after(label):
    w = FOUR_BIT[label]
    bias = torch.randn(w.outputs, generator=torch.Generator().manual_seed(9))
    x = torch.randn(70, w.inputs, generator=torch.Generator().manual_seed(10))
    want = each_row_alone(x, w) + bias
    for threads in (1, 2):
        assert torch.equal(gemm(x, w, threads, bias), want), (label, threads)


def test_a_row_block_edge_leaves_fewer_rows_than_a_pair_of_groups():
    """K = 512: a row block is 768 rows (384 KB of codes); 790 rows leave 22 rows, on the pair kernel."""
    w = FOUR_BIT["Q4_K N=72"]
    x = torch.randn(790, 512, generator=torch.Generator().manual_seed(3))
    got = gemm(x, w, threads=2)
    assert torch.equal(got[750:], each_row_alone(x[750:], w))
    assert torch.equal(got[:40], each_row_alone(x[:40], w))


def _gate_up_weights():
    """(label, tiled [gate | up] weight): ones the fused op runs in lanes (4-bit, 2I a multiple of 32) and ones it
    hands to tiled_gemm and gated (I = 36: not whole pairs of tiles; 8-bit codes)."""
    for qtype, (N, K) in ((QT.Q4_1, (64, 576)), (QT.Q4_K, (96, 512)), (QT.Q4_1, (72, 576)), (QT.Q8_0, (64, 256))):
        yield f"{qtype.name} N={N}", repack(qtype.name, random_blocks(qtype, (N, K), seed=N), (N, K), tile=True)
    yield "int4 N=64", quantize_matrix(torch.randn(64, 256, generator=torch.Generator().manual_seed(6)), "int4")


GATE_UP = dict(_gate_up_weights())


@pytest.mark.parametrize("label", GATE_UP)
@pytest.mark.parametrize("kind", [0, 1], ids=["silu", "gelu_tanh"])
def test_the_fused_gated_product_gives_the_gated_op_on_the_products_bits(label, kind):
    w = GATE_UP[label]
    x = torch.randn(100, w.inputs, generator=torch.Generator().manual_seed(7)) * 2
    want = ops.gated(each_row_alone(x, w), kind)
    wide = ops.set_avx512()
    try:
        for avx512 in (True, False):
            ops.set_avx512(avx512 and wide)
            for M in (2, 31, 32, 47, 100):
                for threads in (1, 2):
                    got = ops.tiled_gated_gemm(x[:M], w.codes, w.scale, w.mins, w.bits, w.outputs, threads, kind)
                    assert torch.equal(got, want[:M]), (label, kind, avx512, M, threads)
    finally:
        ops.set_avx512(wide)


def test_an_mlp_takes_the_fused_op_where_its_product_would_take_tiled_gemm(monkeypatch):
    """FusedProjection.gated: int8 rows of a tiled gate_up (prompt rows under "int8-mlp" and "int8", generated
    rows of several) on the fused op, with the unfused bits; exact prompt rows and one row not."""
    from fastdecode.layers.fused import FusedProjection
    from fastdecode.layers.products import KernelChoice, Products

    w = GATE_UP["Q4_1 N=64"]
    projection = FusedProjection(((dataclasses.replace(w, in_mlp=True), None),), (32, 32))
    x = torch.randn(2, 20, 576, generator=torch.Generator().manual_seed(11))  # [B, T, K]
    calls = []
    real = ops.tiled_gated_gemm
    monkeypatch.setattr(ops, "tiled_gated_gemm", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    cases = [(Products.prompt(2, kernels=KernelChoice(prompt_rows="int8-mlp")), x, 40),
             (Products.prompt(2, kernels=KernelChoice(prompt_rows="int8")), x, 40),
             (Products.generated(2, kernels=KernelChoice()), x[:, :3], 6),
             (Products.prompt(2, kernels=KernelChoice(prompt_rows="exact")), x, None),
             (Products.generated(2, kernels=KernelChoice()), x[:1, :1], None)]
    for products, rows, fused_rows in cases:
        calls.clear()
        got = projection.gated(rows, "silu", products)
        assert calls == ([fused_rows] if fused_rows else []), (products, fused_rows)
        assert torch.equal(got, ops.gated(projection(rows, products), 0)), (products, fused_rows)


@pytest.mark.parametrize("kind", ["gemma3", "gemma2", "olmo2"])
def test_every_family_with_a_gate_up_projection_takes_the_fused_op_on_a_prompt(kind, tmp_path, monkeypatch):
    """Gemma 3 / Gemma 2 (GELU tanh) and OLMo 2 (SiLU), quantized to int4 at load: each block's MLP runs its 40 prompt
    rows through FusedProjection.gated's fused op, with the logits of the gated op on the unfused product."""
    from fastdecode.layers.elementwise import gated
    from fastdecode.layers.fused import FusedProjection
    from tiny_models import prefill_logits, save_tiny_folder

    import fastdecode

    save_tiny_folder(tmp_path, kind, with_tokenizer=False)
    model = fastdecode.load(str(tmp_path), quantize="int4")
    ids = torch.randint(3, 100, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []
    real = ops.tiled_gated_gemm
    monkeypatch.setattr(ops, "tiled_gated_gemm", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    fused = prefill_logits(model, ids)  # [T, V]
    assert calls == [len(ids)] * model.config.num_layers
    monkeypatch.setattr(FusedProjection, "gated",
                        lambda self, x, activation, products: gated(self(x, products), activation,
                                                                    threads=products.threads))
    calls.clear()
    assert torch.equal(fused, prefill_logits(model, ids)) and not calls
