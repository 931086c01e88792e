"""The int8 GEMM of many rows on AMX's tile unit: ``ops.tiled_gemm`` (layers/qgemm_amx.cpp, the tiled
layout) and ``ops.prompt_qmatmul`` on Q6_K's rows layout (layers/qprompt_amx.cpp).

Oracles: the kernels it stands in for, bit for bit (the tiled decode kernel ``qmatmul`` with int8
activations, the VNNI / AVX2 prompt GEMM), and a float64 emulation of its own arithmetic (activations
rounded to int8 per 32 inputs, exact integer dot products per block, then the scales and the mins term).
Every packed format the tiled layout holds, as GGUF blocks repack (compact K-quant scales, float16
scales, mins) and as quantized at load; row counts straddling every edge (the AMX thresholds of 32 rows
(tiled) and 8 (Q6_K), A tiles of 16, row groups of 32, a row block); output counts straddling panels of 32 and partial tiles;
1 and 2 threads. Where the CPU (or OS) has no AMX the same ops run their other kernels and the AMX
cases skip."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kquant_gguf import random_blocks  # noqa: E402

from fastdecode.layers import kscales, ops  # noqa: E402
from fastdecode.layers.products import KernelChoice, Products  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight, quantize_matrix, quantized_linear, rows_layout  # noqa: E402
from fastdecode.loading.gguf_blocks import repack  # noqa: E402

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C++ kernels on this machine")
HAS_AMX = ops.available() and ops.set_amx()
KERNELS = [pytest.param(False, id="no-amx"),
           pytest.param(True, id="amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX here"))]
ROWS = (1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 64, 70)


@pytest.fixture(params=KERNELS)
def amx(request):
    """Runs the test with AMX on (where the CPU has it) or off; back on after."""
    ops.set_amx(request.param)
    yield request.param
    ops.set_amx(True)


def _tiled_weights():
    """(label, tiled QuantizedWeight): every GGUF type with groups of 32 as loaded, and ours."""
    for qtype, (N, K) in ((QT.Q8_0, (72, 512)), (QT.Q4_0, (40, 256)), (QT.Q4_1, (13, 256)), (QT.Q5_0, (72, 256)),
                          (QT.Q4_K, (72, 512)), (QT.Q4_K, (5, 256)), (QT.Q5_K, (40, 512))):
        weight = repack(qtype.name, random_blocks(qtype, (N, K), seed=N + K), (N, K), tile=True)
        assert weight.is_tiled
        yield f"{qtype.name} N={N}", weight
    for kind in ("int8", "int4"):
        yield kind, quantize_matrix(torch.randn(100, 256, generator=torch.Generator().manual_seed(8)), kind)


TILED = dict(_tiled_weights())


def gemm(x: torch.Tensor, w: QuantizedWeight, threads: int = 1) -> torch.Tensor:
    return ops.tiled_gemm(x, w.codes, w.scale, w.mins, w.bits, w.outputs, threads)


def decode_kernel(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    return ops.qmatmul(x, w.codes, w.scale, w.mins, w.bits, w.group, 1, 8, w.outputs)


def emulated(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """float64 [M, N]: per block of 32, exact int dot of codes and int8 activations x scale x d, + mins x d x sum a."""
    M, K = x.shape
    blocks = x.view(M, K // 32, 32)  # [M, K/32, 32]
    top = blocks.abs().amax(-1, keepdim=True)  # [M, K/32, 1]
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))  # float32, as in C++
    a = torch.round(blocks * inverse).to(torch.int64)  # [M, K/32, 32]
    d = (top / 127).double()[..., 0]  # [M, K/32]
    codes, scale, mins = rows_layout(w)
    if kscales.is_compact(scale):
        scale, mins = kscales.expand(scale, 32), None if mins is None else kscales.expand(mins, 32)
    N = scale.shape[0]
    if w.bits == 4:
        nibbles = codes.view(N, K // 32, 16).to(torch.int64) & 0xFF  # [N, K/32, 16] bytes
        values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # [N, K/32, 32]: low then high
    else:
        values = codes.view(N, K // 32, 32).to(torch.int64)  # [N, K/32, 32]
    dots = torch.einsum("mbi,nbi->mnb", a, values).double()  # [M, N, K/32] exact
    y = (dots * scale.double()[None] * d[:, None]).sum(-1)  # [M, N]
    if mins is not None:
        y = y + (d * a.sum(-1).double()) @ mins.double().T  # [M, K/32] @ [K/32, N]
    return y


@pytest.mark.parametrize("label", TILED)
def test_tiled_gemm_gives_the_tiled_kernels_bits_on_1_and_2_threads(amx, label):
    w = TILED[label]
    x = torch.randn(max(ROWS), w.inputs, generator=torch.Generator().manual_seed(1))
    for M in ROWS:
        want = decode_kernel(x[:M], w)
        assert torch.equal(gemm(x[:M], w), want), (label, M)
        assert torch.equal(gemm(x[:M], w, threads=2), want), (label, M)


@pytest.mark.parametrize("label", ["Q4_K N=72", "Q8_0 N=72", "int4", "Q4_1 N=13"])
def test_tiled_gemm_is_its_own_arithmetic_in_float64(amx, label):
    w = TILED[label]
    x = torch.randn(40, w.inputs, generator=torch.Generator().manual_seed(2))
    for M in (8, 17, 40):
        want = emulated(x[:M], w)
        assert float((gemm(x[:M], w).double() - want).abs().amax() / want.abs().amax()) < 2e-6, (label, M)


@pytest.mark.parametrize("label", ["Q4_K N=72", "Q4_1 N=13", "Q8_0 N=72", "int8"])
def test_a_bias_gives_the_bits_of_adding_it_after_on_every_kernel(amx, label):
    """tiled_gemm's bias is added to each output as it is stored (AMX's epilogue, the tiled kernels' pass
    over their outputs): the same float addition as adding it to the product after, on AMX, AVX-512 and
    AVX2, 1 and 2 threads, outputs straddling panels and partial tiles."""
    w = TILED[label]
    bias = torch.randn(w.outputs, generator=torch.Generator().manual_seed(9))
    x = torch.randn(max(ROWS), w.inputs, generator=torch.Generator().manual_seed(10))
    try:
        for avx512 in (True, False):
            ops.set_avx512(avx512)
            ops.set_amx(amx)
            for M in ROWS:
                want = gemm(x[:M], w) + bias
                for threads in (1, 2):
                    got = ops.tiled_gemm(x[:M], w.codes, w.scale, w.mins, w.bits, w.outputs, threads, bias)
                    assert torch.equal(got, want), (label, avx512, M, threads)
    finally:
        ops.set_avx512(True)
        ops.set_amx(amx)
    with pytest.raises(RuntimeError, match=f"bias has 5 values for {w.outputs} outputs"):
        ops.tiled_gemm(x[:9], w.codes, w.scale, w.mins, w.bits, w.outputs, 1, bias[:5].contiguous())


def test_a_row_block_edge_and_the_rows_past_it(amx):
    """K = 512: a row block is 2048 rows (1 MB of activations); 2049 rows start a second one."""
    w = TILED["Q4_K N=72"]
    x = torch.randn(2049, 512, generator=torch.Generator().manual_seed(3))
    got = gemm(x, w, threads=2)
    assert torch.equal(got[2040:], decode_kernel(x[2040:], w))
    assert torch.equal(got[:9], decode_kernel(x[:9], w))


def test_many_rows_quantized_on_2_threads_keep_their_bits(amx):
    """600 x 512 activations: 9600 blocks of 32, quantized in chunks over both threads (qrows.h's
    quantize_rows with the caller's threads), the product repeated so that the helper is awake for it."""
    w = TILED["Q4_K N=72"]
    x = torch.randn(600, 512, generator=torch.Generator().manual_seed(4))
    want = torch.cat([decode_kernel(x[m:m + 50], w) for m in range(0, 600, 50)])
    for _ in range(5):
        assert torch.equal(gemm(x, w, threads=2), want)


def q6k(N: int, K: int, seed: int, half: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-32, 32, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, K // 16, generator=g) * 0.02 + 1e-3
    return codes, scale.half() if half else scale


@pytest.mark.skipif(not HAS_AMX, reason="no AMX here")
@pytest.mark.parametrize("N, K, half", [(40, 256, False), (13, 512, True), (70, 96, False)])
def test_the_q6k_prompt_gemm_on_amx_gives_the_vnni_and_avx2_bits(N, K, half):
    codes, scale = q6k(N, K, seed=N, half=half)
    x = torch.randn(max(ROWS), K, generator=torch.Generator().manual_seed(4))
    try:
        for M in ROWS:
            ops.set_amx(False)
            want = ops.prompt_qmatmul(x[:M], codes, scale, 1)
            ops.set_avx512(False)
            assert torch.equal(ops.prompt_qmatmul(x[:M], codes, scale, 1), want), M  # AVX2
            ops.set_avx512(True)
            ops.set_amx(True)
            assert torch.equal(ops.prompt_qmatmul(x[:M], codes, scale, 1), want), M
            assert torch.equal(ops.prompt_qmatmul(x[:M], codes, scale, 2), want), M
    finally:
        ops.set_avx512(True)
        ops.set_amx(True)


def test_amx_is_off_when_avx512_is():
    try:
        ops.set_avx512(False)
        assert not ops.set_amx()
    finally:
        ops.set_avx512(True)
    assert ops.set_amx() == HAS_AMX


def test_int8_prompt_rows_and_multi_row_steps_of_a_tiled_weight_take_the_gemm(monkeypatch):
    """Prompt rows on int8 and generated steps of several rows go through tiled_gemm (one row: the
    decode kernel); a step mixing both gives each row its result alone; a bias is the same addition."""
    w = TILED["Q4_K N=72"]
    bias = torch.randn(72)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(5))
    calls = []
    real = ops.tiled_gemm
    monkeypatch.setattr(ops, "tiled_gemm", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    int8 = KernelChoice(prompt_rows="int8")
    prompt = quantized_linear(x, w, bias, products=Products.prompt(2, kernels=int8))
    generated = quantized_linear(x, w, bias, products=Products.generated(2, kernels=int8))
    assert calls == [12, 12]
    assert torch.equal(prompt, generated) and torch.equal(prompt, decode_kernel(x, w) + bias)
    one = quantized_linear(x[:1], w, bias, products=Products.generated(1, kernels=int8))
    assert calls == [12, 12] and torch.equal(one, prompt[:1])
