"""The int8 prompt GEMM for the rows layout's 8-bit codes in groups of 16 (Q6_K: layers/qprompt.cpp).

Oracle: a float64 emulation of its own arithmetic (activations rounded to int8 per 32 inputs as the kernel
does, exact integer dot products per 16 inputs, then the scales). Every ISA path runs: the AVX2 kernel on
every machine with the extension (forced where the CPU has AVX-512), the AVX-512 VNNI kernel where the CPU
has it, and the two must give the same bits. Row counts straddle the row blockings (8, 4, 2, 1) and
output counts the 16-output pair tiles."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_isas import HAS_AVX512, avx512_gives_the_avx2_bits

from fastdecode.layers import ops, quantized
from fastdecode.layers.products import KernelChoice, Products
from fastdecode.layers.quantized import QuantizedWeight, quantized_linear

op = ops.prompt_qmatmul if ops.available() else None
pytestmark = pytest.mark.skipif(op is None, reason="no AVX2 kernel on this machine")
ISAS = ["avx2", pytest.param("avx512", marks=pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 VNNI here"))]
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 17, 30)


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test on one ISA's kernels (the AVX-512 ones switched back on after, where the CPU has them)."""
    ops.set_avx512(request.param == "avx512")
    yield request.param
    ops.set_avx512(True)


def q6k_like(N: int, K: int, seed: int, extremes: bool = False, half: bool = False) -> QuantizedWeight:
    """A rows-layout weight of 8-bit codes in groups of 16 (Q6_K's: codes -32..31; extremes: -128..127)."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-128, 128) if extremes else (-32, 32)
    codes = torch.randint(low, high, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, K // 16, generator=g) * 0.02 + 1e-3
    return QuantizedWeight("Q6_K", 8, 16, codes, scale.half() if half else scale, None)


def emulated(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """float64 [M, N]: sum over groups of 16 of (exact int dot of codes and int8 activations) x scale x d."""
    M, K = x.shape
    blocks = x.view(M, K // 32, 32)  # [M, K/32, 32]
    top = blocks.abs().amax(-1, keepdim=True)  # [M, K/32, 1]
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))  # float32, as in C++
    a = torch.round(blocks * inverse).to(torch.int64).view(M, K // 16, 16)  # [M, K/16, 16]
    d = (top / 127).double().repeat_interleave(2, dim=1)[..., 0]  # [M, K/16]
    codes = weight.codes.to(torch.int64).view(-1, K // 16, 16)  # [N, K/16, 16]
    dots = torch.einsum("mgi,ngi->mng", a, codes).double()  # [M, N, K/16] exact
    return (dots * weight.scale.double()[None] * d[:, None]).sum(-1)  # [M, N]


def run(x: torch.Tensor, weight: QuantizedWeight, threads: int = 1) -> torch.Tensor:
    return op(x, weight.codes, weight.scale, threads)


@pytest.mark.parametrize("N", [8, 16, 23, 40])
@pytest.mark.parametrize("K", [32, 96, 256])
def test_prompt_gemm_is_its_own_arithmetic_in_float64(isa, N, K):
    weight = q6k_like(N, K, seed=N + K)
    x = torch.randn(max(ROWS), K, generator=torch.Generator().manual_seed(K))
    for M in ROWS:
        got, want = run(x[:M], weight), emulated(x[:M], weight)
        scale = want.abs().amax() + 1e-30
        assert float((got.double() - want).abs().amax() / scale) < 2e-6, (M, N, K)


def test_codes_at_the_extremes_do_not_saturate(isa):
    """8-bit codes of -128..127 against activations at +-127: AVX2's maddubs pair sums stay below 2^15
    (the sign trick), VNNI's offset activations below int32's range."""
    weight = q6k_like(33, 256, seed=3, extremes=True)
    x = torch.where(torch.rand(12, 256, generator=torch.Generator().manual_seed(4)) < 0.5, -1.0, 1.0)
    got, want = run(x, weight), emulated(x, weight)
    assert float((got.double() - want).abs().amax() / want.abs().amax()) < 2e-6


@pytest.mark.parametrize("half", [False, True], ids=["float32 scales", "float16 scales"])
def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_2_threads(isa, half):
    weight = q6k_like(70, 512, seed=5, half=half)
    x = torch.randn(max(ROWS), 512, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([run(x[m:m + 1], weight) for m in range(max(ROWS))])
    for M in ROWS:
        for start in (0, M // 2):
            assert torch.equal(run(x[start:start + M], weight), alone[start:start + M]), (M, start)
        assert torch.equal(run(x[:M], weight, threads=2), alone[:M]), M


@pytest.mark.skipif(not HAS_AVX512, reason="no AVX-512 VNNI here")
def test_the_avx512_kernel_gives_the_avx2_bits():
    weight = q6k_like(45, 1024, seed=7)
    x = torch.randn(37, 1024, generator=torch.Generator().manual_seed(8))
    avx512_gives_the_avx2_bits(lambda M: run(x[:M], weight), [(M,) for M in (1, 2, 3, 8, 9, 37)])


@pytest.mark.parametrize("N", [13, 40])
def test_a_bias_gives_the_bits_of_adding_it_after(isa, N):
    """The optional bias is added to each output as it is stored (AVX2 and VNNI: after each pair tile;
    AMX, at many rows where the CPU has it: in its epilogue): the bits of adding it after the product."""
    weight = q6k_like(N, 256, seed=11)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(12))
    x = torch.randn(max(ROWS), 256, generator=torch.Generator().manual_seed(13))
    for M in ROWS:
        want = run(x[:M], weight) + bias
        assert torch.equal(op(x[:M], weight.codes, weight.scale, 1, bias), want), M
        assert torch.equal(op(x[:M], weight.codes, weight.scale, 2, bias), want), M


def test_int8_prompt_rows_of_a_q6k_weight_take_the_prompt_gemm():
    """With prompt rows on int8 (``KernelChoice(prompt_rows="int8")``, carried by the products), a Q6_K
    weight's prompt rows run the prompt GEMM, its generated rows the decode kernel, and a step mixing
    both gives each row its result alone."""
    weight = q6k_like(40, 256, seed=9)
    bias = torch.randn(40)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(10))
    int8 = KernelChoice(prompt_rows="int8")
    prompt = quantized_linear(x, weight, bias, products=Products.prompt(1, kernels=int8))
    assert torch.equal(prompt, run(x, weight) + bias)
    generated = quantized_linear(x, weight, bias, products=Products.generated(1, kernels=int8))
    assert not torch.equal(generated, prompt)  # the decode kernel: another summation order
    roles = [True, False, True, True, False, False]
    mixed = quantized_linear(x, weight, bias, products=Products.of_rows(roles, 1, kernels=int8))
    want = torch.stack([prompt[i] if role else generated[i] for i, role in enumerate(roles)])
    assert torch.equal(mixed, want)
    # with exact prompt rows (the default) the prompt GEMM is not used
    exact = quantized_linear(x, weight, bias, products=Products.prompt(1, kernels=KernelChoice()))
    assert not torch.equal(exact, prompt)
    # a weight with mins, or a tiled one, keeps the decode kernel for int8 prompt rows
    assert not quantized.has_prompt_kernel(dataclasses.replace(weight, mins=weight.scale))


def test_bad_arguments_are_named():
    weight = q6k_like(16, 64, seed=1)
    with pytest.raises(RuntimeError, match="x has 32 inputs, the weight 64"):
        op(torch.randn(2, 32), weight.codes, weight.scale, 1)
    with pytest.raises(RuntimeError, match="not one per 16 codes"):
        op(torch.randn(2, 64), weight.codes, weight.scale[:, :2].contiguous(), 1)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[16\]"):
        op(torch.randn(2, 64), weight.codes, weight.scale, 1, torch.zeros(15))
