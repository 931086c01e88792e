"""Quantized execution: GGUF blocks run as they are (float checkpoints quantized at load:
test_quantize_at_load.py; whole models: test_quantized_models.py).

Oracles: ``gguf.quants.dequantize`` (the gguf package's own decoder) for every block type; the
dequantized float32 path of the same file (itself checked against transformers in
test_gguf_loading.py) for whole models.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402
from kernel_isas import avx512_gives_the_avx2_bits, needs_avx512, rows_and_threads  # noqa: E402
from kquant_gguf import random_blocks  # noqa: E402

from fastdecode.layers import ops, quantized  # noqa: E402
from fastdecode.layers.products import KernelChoice, Products  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight, dequantize, quantize_matrix, rows_layout, tiled  # noqa: E402
from fastdecode.loading.gguf_blocks import repack  # noqa: E402

GGUF_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


# --- 1: every block type decodes bit-exactly, and the kernels multiply it --------------------------
@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_repacked_blocks_decode_exactly_as_the_gguf_package(qtype):
    shape = (48, 512)
    raw = random_blocks(qtype, shape, seed=1)
    weight = repack(qtype.name, raw, shape)
    reference = torch.from_numpy(gguf_dequantize(raw, qtype).reshape(shape))
    assert torch.equal(dequantize(weight), reference)  # bit-identical weights
    # the AVX2 decoder (prefill), too
    assert torch.equal(quantized.dense_weight(weight, work=1 << 30, threads=torch.get_num_threads()), reference)
    rows = torch.tensor([5, 0, 47, 5])
    assert torch.equal(dequantize(weight, rows), reference[rows])  # embedding lookups decode rows only
    # embedding rows: the extension's decoder on the rows looked up where it has the format, else ``dequantize``
    assert torch.equal(quantized.embed(rows.view(2, 2), weight), reference[rows].view(2, 2, -1))
    assert torch.equal(quantized.embed(rows.view(2, 2), repack(qtype.name, raw, shape, compact=False)),
                       reference[rows].view(2, 2, -1))


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [48, 13])
def test_repacking_straight_into_tiles_gives_the_tiled_bytes(qtype, rows):
    """repack(tile=True) copies the blocks once, straight into the tiled layout (a load's path): the same
    bytes as tiling the rows layout, for a read-only source (the file's memory map) that stays untouched,
    and a partial last tile (padded)."""
    shape = (rows, 512)
    raw = random_blocks(qtype, shape, seed=3)
    source = np.frombuffer(raw.tobytes(), dtype=np.uint8).reshape(raw.shape)  # read-only, as the memory map
    direct, by_rows = repack(qtype.name, source, shape, tile=True), tiled(repack(qtype.name, raw, shape))
    assert direct.is_tiled == by_rows.is_tiled == (qtype != QT.Q6_K)  # Q6_K has groups of 16: rows layout
    assert (direct.outputs, direct.shape) == (by_rows.outputs, by_rows.shape)
    for mine, theirs in ((direct.codes, by_rows.codes), (direct.scale, by_rows.scale), (direct.mins, by_rows.mins)):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)
            assert not np.shares_memory(mine.numpy(), source)  # a copy, never the map itself
    assert torch.equal(dequantize(direct), torch.from_numpy(gguf_dequantize(raw, qtype).reshape(shape)))


def _weights_of_every_type():
    """(label, QuantizedWeight [72, 512]) for every GGUF type, in the rows layout (as repacked) and the
    tiled one (as loaded: every type with groups of 32), and quantize="int8" / "int4" (tiled); plus
    tiled ones whose last tile is partial (N = 13, 5)."""
    shape = (72, 512)
    for qtype in GGUF_TYPES:
        weight = repack(qtype.name, random_blocks(qtype, shape, seed=2), shape)
        yield qtype.name, weight
        if tiled(weight) is not weight:
            yield f"{qtype.name} tiled", tiled(weight)
    for kind in ("int8", "int4"):
        yield kind, quantize_matrix(torch.randn(shape, generator=torch.Generator().manual_seed(8)), kind)
    for qtype, rows in ((QT.Q4_1, 13), (QT.Q8_0, 5)):
        yield f"{qtype.name} tiled N={rows}", tiled(repack(qtype.name, random_blocks(qtype, (rows, 256), seed=5), (rows, 256)))


WEIGHTS = dict(_weights_of_every_type())


def _activation_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation quantization, emulated: x [M, K] -> (xq = d * a, d per element) [M, K],
    a = round-half-even(x * (127 / max|x|)) per block of 32 inputs, d = max|x| / 127 (float32 as in C++)."""
    M, K = x.shape
    blocks = x.view(M, K // 32, 32)  # [M, K/32, 32]
    top = blocks.abs().amax(-1, keepdim=True)  # [M, K/32, 1]
    inverse = torch.where(top > 0, 127 / top, torch.zeros_like(top))
    d = top / 127
    return (torch.round(blocks * inverse) * d).view(M, K), d.expand(M, K // 32, 32).reshape(M, K)


def _kernel(x: torch.Tensor, weight: QuantizedWeight, activation_bits: int = 8) -> torch.Tensor:
    return ops.qmatmul(x, weight.codes, weight.scale, weight.mins, weight.bits, weight.group, 1 << 40,
                       activation_bits, weight.outputs)


needs_kernel = pytest.mark.skipif("not ops.available()", reason="no AVX2 kernel on this machine")


def roles(is_prompt: bool | list[bool]) -> Products:
    """A forward's products with these row roles, on this thread's thread count."""
    return Products.of_rows(is_prompt, torch.get_num_threads(), kernels=KernelChoice())


def generated() -> Products:
    return roles(False)


@needs_kernel
@pytest.mark.parametrize("label", WEIGHTS)
def test_kernel_is_the_exact_product_with_int8_rounded_activations(label):
    """The integer arithmetic, emulated in float64: the kernel computes sum_k w[n, k] * xq[m, k] (codes
    times activation codes in int32, then scales), so only float32 rounding of the sums remains."""
    weight = WEIGHTS[label]
    x = torch.randn(13, weight.shape[1], generator=torch.Generator().manual_seed(3))
    dense = dequantize(weight).double()
    xq, _ = _activation_rounding(x)
    expected = xq.double() @ dense.T
    bound = 1e-5 * (xq.double().abs() @ dense.abs().T)  # float32 sums of K/32 block products
    assert ((_kernel(x, weight) - expected).abs() <= bound).all()


# Tolerance against the dequantized-float32 product (the kernel's only rounding is the activations'):
#   y_kernel - y_float = sum_k w[n, k] (xq - x)[m, k],  |xq - x| <= d_b / 2,  d_b = max|x in block b| / 127
# so, rigorously, |y_kernel - y_float| <= sum_k |w[n, k]| d_b(k) / 2 (+ float32 rounding, 1e-5 relative).
# That bound is reached only if every rounding goes the same way; the roundings are ~uniform and
# independent, (xq - x) ~ U(-d/2, d/2) with variance d^2 / 12, so the error's RMS over outputs is
#   sigma[m, n] = sqrt(sum_k w[n, k]^2 d_b(k)^2 / 12),
# which pins each type's tolerance to its own weights: asserted <= 1.5 sigma (measured 0.9-1.05; a
# wrong scale, sign or nibble order gives errors of the product's own size, ~30-100 sigma). For
# Gaussian activations d / 2 ~ 2.4 sigma_x / 254, so the relative error is ~0.3% of a product's RMS
# for every type: an int8 activation moves by at most 1/254 of its block's largest value. llama.cpp
# accepts the same rounding (Q8_0 / Q8_1 activation blocks of 32; Q8_K blocks of 256 for K-quants,
# coarser than ours) and its test-quantize-fns allows a dot-product error of 0.02 per element.
@needs_kernel
@pytest.mark.parametrize("label", WEIGHTS)
def test_kernel_error_against_the_float_product_is_the_activation_rounding(label):
    weight = WEIGHTS[label]
    x = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(3)).double()
    dense = dequantize(weight).double()
    error = _kernel(x.float(), weight).double() - x @ dense.T  # [M, N]
    _, d = _activation_rounding(x.float())
    worst = (d.double() / 2) @ dense.abs().T + 1e-5 * (x.abs() @ dense.abs().T)
    assert (error.abs() <= worst).all()
    sigma = ((d.double() ** 2 / 12) @ (dense**2).T).sqrt()
    rms_ratio = float(error.pow(2).mean().sqrt() / sigma.pow(2).mean().sqrt())
    print(f"{label}: error RMS {rms_ratio:.2f} sigma")
    assert rms_ratio <= 1.5


def _odd_width_weights(K: int):
    """Weights whose K/32 blocks are not a whole number of the kernel's 8-block scale passes (K = 96: a
    partial pass only; K = 608: two full passes and 3 blocks), one of each code layout: 8-bit float16
    G32 (Q8_0), 4-bit float16 scales + mins (Q4_1), 4-bit float32 (int4), 8-bit float32 G16 (Q6_K's)."""
    rng = np.random.default_rng(K)
    yield "Q8_0", repack("Q8_0", gguf_quantize((0.1 * rng.standard_normal((24, K))).astype(np.float32), QT.Q8_0), (24, K))
    yield "Q4_1", repack("Q4_1", gguf_quantize((0.1 * rng.standard_normal((24, K))).astype(np.float32), QT.Q4_1), (24, K))
    yield "int4", quantize_matrix(torch.from_numpy(rng.standard_normal((24, K)).astype(np.float32)), "int4")
    yield "Q8_0 tiled", tiled(repack("Q8_0", gguf_quantize((0.1 * rng.standard_normal((21, K))).astype(np.float32), QT.Q8_0), (21, K)))
    codes = torch.from_numpy(rng.integers(-128, 128, (24, K), dtype=np.int8))
    scale = torch.from_numpy(rng.uniform(1e-3, 4e-3, (24, K // 16)).astype(np.float32))
    yield "G16", QuantizedWeight("Q6_K", 8, 16, codes, scale, None)


@needs_kernel
@pytest.mark.parametrize("K", [96, 608])
def test_partial_scale_passes_are_the_same_exact_product(K):
    """The kernel combines weight and activation scales 8 blocks at a time; the blocks left over take a
    scalar path that must give the same product (float64 emulation) and the same bits per row."""
    for label, weight in _odd_width_weights(K):
        x = torch.randn(11, K, generator=torch.Generator().manual_seed(4))
        dense = dequantize(weight).double()
        xq, _ = _activation_rounding(x)
        expected = xq.double() @ dense.T
        together = _kernel(x, weight)
        assert ((together - expected).abs() <= 1e-5 * (xq.double().abs() @ dense.abs().T)).all(), label
        for rows in ([4], [10, 2], list(range(1, 9))):
            assert torch.equal(_kernel(x[rows], weight), together[rows]), label


@needs_kernel
def test_8_bit_codes_at_the_extremes_do_not_saturate():
    """maddubs' int16 pair sums: codes -128 and 127 against activations of +-127 (every input at its
    block's largest magnitude) stay exact (2 * 128 * 127 = 32512 < 32767)."""
    N, K = 4, 64
    codes = torch.tensor([-128, 127, -128, -128]).repeat(N, K // 4).to(torch.int8)  # [N, K]
    weight = QuantizedWeight("Q8_0", 8, 32, codes, torch.full((N, K // 32), 0.5, dtype=torch.float16), None)
    x = torch.tensor([[-3.0, 3.0, -3.0, -3.0] * (K // 4), [3.0, -3.0, 3.0, 3.0] * (K // 4)])  # [2, K]
    torch.testing.assert_close(_kernel(x, weight), x @ dequantize(weight).T, atol=1e-3, rtol=0)
    torch.testing.assert_close(_kernel(x, tiled(weight)), x @ dequantize(weight).T, atol=1e-3, rtol=0)


@needs_kernel
def test_4_bit_codes_at_the_extremes_do_not_overflow_the_int16_block_sums():
    """The tiled 4-bit kernel adds a block's 16 products per int16 lane before widening: codes 15 against
    activations of +-127 everywhere reach 16 * 15 * 127 = 30480 < 32767, exactly."""
    N, K = 8, 64
    codes = torch.full((N, K // 2), 0xFF, dtype=torch.uint8)  # every nibble 15
    scale = torch.full((N, K // 32), 0.5, dtype=torch.float16)
    weight = tiled(QuantizedWeight("Q4_1", 4, 32, codes, scale, torch.zeros_like(scale)))
    x = torch.tensor([[3.0] * K, [-3.0] * K])  # [2, K]: every activation code +-127
    torch.testing.assert_close(_kernel(x, weight), x @ dequantize(weight).T, atol=1e-3, rtol=0)


@needs_kernel
@pytest.mark.parametrize("label", [label for label, weight in WEIGHTS.items() if weight.is_tiled])
@pytest.mark.parametrize("activation_bits", [8, 32])
def test_tiled_rows_are_the_same_bits_at_every_row_count_and_thread_count(label, activation_bits):
    """The tiled kernels block rows by 8, 4, 2 and 1, in blocks that stay in L2 (192 to 768 rows here), and
    outputs by tiles (chunks of tiles per thread): a row's bits must not depend on M, on its position or on
    the thread count, and a partial last tile must give its real outputs only."""
    weight = WEIGHTS[label]
    x = torch.randn(800, weight.shape[1], generator=torch.Generator().manual_seed(10))
    op = ops.qmatmul
    alone = torch.cat([op(x[m : m + 1], weight.codes, weight.scale, weight.mins, weight.bits, 32, 1, activation_bits,
                          weight.outputs) for m in range(0, 800, 23)])  # rows 0, 23, ... one at a time
    for M in (1, 3, 8, 33, 300, 800):
        for threads in (1, 2):
            y = op(x[:M], weight.codes, weight.scale, weight.mins, weight.bits, 32, threads, activation_bits,
                   weight.outputs)
            assert y.shape == (M, weight.outputs)
            assert torch.equal(y[::23], alone[: len(y[::23])]), (M, threads)


@needs_kernel
@pytest.mark.parametrize("label", list(WEIGHTS))
def test_a_bias_added_inside_the_kernel_is_the_same_addition(label):
    """qmatmul(..., bias) adds the bias to each output once it is summed: bitwise product + bias, in every
    layout, row block and thread count (and quantized_linear passes it there)."""
    weight = WEIGHTS[label]
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(800, weight.shape[1], generator=generator)
    bias = torch.randn(weight.outputs, generator=generator)
    op = ops.qmatmul
    for M in (1, 8, 800):
        for threads in (1, 2):
            args = (x[:M], weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads, 8,
                    weight.outputs)
            assert torch.equal(op(*args, bias), op(*args) + bias), (M, threads)
    with pytest.raises(RuntimeError, match=f"bias has {weight.outputs - 1} values for {weight.outputs} outputs"):
        op(*args, bias[:-1])
    fused = quantized.quantized_linear(x[:8], weight, bias, generated())
    assert torch.equal(fused, quantized.quantized_linear(x[:8], weight, None, generated()) + bias)


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("label", [label for label, weight in WEIGHTS.items() if weight.is_tiled])
def test_the_avx512_kernels_give_the_avx2_bits(label):
    """Where the CPU has AVX-512 VNNI the int8 products run two tiles per instruction (qtiles_avx512.cpp);
    the integer dot products are exact either way and the float steps the same per output, so every
    result must be bit for bit the AVX2 kernel's: at each row blocking (8, 4, 2, 1 rows and the
    leftovers), odd tile counts (an AVX2 tile beside the pairs) and padded last tiles, both thread counts."""
    weight = WEIGHTS[label]
    x = torch.randn(45, weight.shape[1], generator=torch.Generator().manual_seed(11))
    op = ops.qmatmul
    avx512_gives_the_avx2_bits(
        lambda M, threads: op(x[:M], weight.codes, weight.scale, weight.mins, weight.bits, 32, threads, 8,
                              weight.outputs), rows_and_threads((1, 2, 3, 4, 5, 8, 13, 45)))


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("label", ["Q6_K", "Q6_K N=13", "Q8_0", "Q5_0", "Q5_K"])
@pytest.mark.parametrize("activation_bits", [8, 32])
def test_the_avx512_row_layout_kernels_give_the_avx2_bits(label, activation_bits):
    """The rows layout's 8-bit codes (and Q6_K's packed 6-bit ones: V, down and output matrices) run two outputs per AVX-512
    register (rows_avx512.cpp): int8 activations in groups of 16 with VNNI (exact int32 lanes), float32
    ones (the logits layer) for groups of 16 and 32, each half the AVX2 kernel's lanes: bit for bit its
    results, at every row blocking (8, 4, 2, 1 rows), output counts that leave 1 to 3 outputs to the AVX2
    kernel (13), float16 scales and mins (Q5_K; these stay on AVX2)."""
    if label == "Q6_K N=13":
        weight = repack("Q6_K", random_blocks(QT.Q6_K, (13, 512), seed=4), (13, 512))
    else:
        weight = WEIGHTS[label]
    assert not weight.is_tiled and weight.bits == (6 if label.startswith("Q6_K") else 8)
    x = torch.randn(21, weight.shape[1], generator=torch.Generator().manual_seed(13))
    op = ops.qmatmul
    avx512_gives_the_avx2_bits(
        lambda M, threads: op(x[:M], weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                              activation_bits, weight.outputs), rows_and_threads((1, 2, 3, 4, 5, 8, 13, 21)))


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("label", ["Q4_1 tiled", "Q6_K", "int8", "Q4_1 tiled N=13", "Q8_0 tiled N=5"])
def test_the_avx512_exact_prompt_kernel_gives_the_avx2_bits(label):
    """Prompt rows' exact products (exact_matmul.cpp) with AVX-512 hold two outputs' 8-lane sums per register:
    bit for bit the AVX2 kernel's, at every row blocking (6 rows, a last block of 1-5; AVX2: 4, then 1-3) and odd
    output counts."""
    weight = WEIGHTS[label]
    x = torch.randn(61, weight.shape[1], generator=torch.Generator().manual_seed(12))
    op = ops.exact_qmatmul
    avx512_gives_the_avx2_bits(
        lambda M, threads: op(x[:M], weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                              weight.outputs), rows_and_threads((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 61)))


def test_the_tiled_layout_is_a_byte_shuffle_of_the_rows_layout():
    """tiled() then rows_layout() gives back the rows layout exactly (N = 13: a padded last tile); row
    lookups, take_rows and the C++ decoder read the tiled codes as the rows they came from."""
    shape = (13, 96)
    for qtype in (QT.Q4_1, QT.Q8_0, QT.Q4_0):
        rows = repack(qtype.name, random_blocks(qtype, shape, seed=6), shape)
        weight = tiled(rows)
        assert weight.is_tiled and weight.outputs == 13 and weight.shape == rows.shape
        assert weight.codes.shape[0] == 2 and weight.nbytes < rows.nbytes * 1.25  # one copy (+ 3 padding rows)
        for mine, theirs in zip(rows_layout(weight), rows_layout(rows)):
            assert (mine is None and theirs is None) or torch.equal(mine, theirs)
        picked = torch.tensor([12, 0, 7, 8, 12])
        assert torch.equal(dequantize(weight, picked), dequantize(rows, picked))
        order = torch.randperm(13, generator=torch.Generator().manual_seed(1))
        taken = weight.take_rows(order)
        assert taken.is_tiled and torch.equal(dequantize(taken), dequantize(rows)[order])
        if ops.available():
            assert torch.equal(quantized.dense_weight(weight, work=1 << 30, threads=torch.get_num_threads()),
                               dequantize(rows))


@pytest.mark.parametrize("logits_layer", [False, True], ids=["int8-activations", "for_logits"])
@pytest.mark.parametrize("label", WEIGHTS)
def test_a_row_gets_the_same_bits_whatever_it_is_batched_with(label, logits_layer):
    """Generated rows, at any row count (1 to a prefill's 300): each row's result equals the row alone,
    bit for bit, so a request's tokens never depend on the other requests of its batch (and its row's
    position)."""
    weight = quantized.for_logits(WEIGHTS[label]) if logits_layer else WEIGHTS[label]
    x = torch.randn(300, weight.shape[1], generator=torch.Generator().manual_seed(9))
    together = quantized.quantized_linear(x, weight, None, generated())
    for rows in ([0], [3, 7], [12, 0, 5], list(range(8)), list(range(33)), list(range(299, -1, -2))):
        assert torch.equal(quantized.quantized_linear(x[rows], weight, None, generated()), together[rows])


@pytest.mark.parametrize("label", WEIGHTS)
def test_a_prompt_row_gets_the_same_bits_at_any_row_count(label):
    """Prompt rows (the exact kernel, layers/exact_matmul.cpp): a chunk of 1 to 40 rows gives each row
    the bits it gets in a 300-row product, on 1 or 2 threads, so a prompt's K/V do not depend on how it
    was chunked or batched (the int8 rounding of later generated rows would turn 1e-5 differences into
    different tokens)."""
    weight = WEIGHTS[label]
    x = torch.randn(300, weight.shape[1], generator=torch.Generator().manual_seed(2))
    prompt = roles(True)
    together = quantized.quantized_linear(x, weight, None, prompt)
    for rows in [*range(1, 10), 17, 33, 40]:
        assert torch.equal(quantized.quantized_linear(x[100 : 100 + rows], weight, None, prompt),
                           together[100 : 100 + rows]), rows
    op = ops.exact_qmatmul
    for threads in (1, 2):
        alone = op(x[7:12].contiguous(), weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                   weight.outputs)
        assert torch.equal(alone, together[7:12]), threads


@pytest.mark.parametrize("label", ["Q4_1", "Q6_K", "int8"])
def test_a_step_mixing_prompt_and_generated_rows_gives_each_row_its_alone_result(label):
    """A continuous-batching step: prompt rows (exact float product) and generated rows (int8 kernel)
    in one product: every row equals the same row computed in a product of its own role alone."""
    weight = WEIGHTS[label]
    x = torch.randn(40, weight.shape[1], generator=torch.Generator().manual_seed(5))
    is_prompt = [i % 3 == 1 or i > 30 for i in range(40)]
    mixed = quantized.quantized_linear(x, weight, None, roles(is_prompt))
    for i in (0, 1, 2, 31, 39):
        assert torch.equal(quantized.quantized_linear(x[i : i + 1], weight, None, roles(is_prompt[i]))[0], mixed[i]), i
    dense = dequantize(weight)
    prompt = [i for i, p in enumerate(is_prompt) if p]
    torch.testing.assert_close(mixed[prompt], x[prompt] @ dense.T, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="40"):
        quantized.quantized_linear(x, weight, None, roles(is_prompt[:39]))


@pytest.mark.parametrize("label", WEIGHTS)
@pytest.mark.parametrize("path", ["prompt", "no-kernel", "for_logits"])
def test_prompt_rows_the_fallback_and_the_logits_layer_are_the_exact_float_product(label, path, monkeypatch):
    """Prompt rows (``Products.roles``), at any row count, are the product with the exactly decoded weights
    (the exact kernel); without the AVX2 extension (forced here) every row runs the float GEMM on them;
    the logits layer's kernel
    (for_logits: float32 activations, 8-, 4- and 1-row blocks) too: only summation order differs."""
    if path == "no-kernel":
        monkeypatch.setitem(ops._LOADED, "ops", None)
    weight = quantized.for_logits(WEIGHTS[label]) if path == "for_logits" else WEIGHTS[label]
    for rows in {"prompt": [1, 33, 512], "no-kernel": [1, 8, 33], "for_logits": [1, 3, 5, 13]}[path]:
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(3))
        bias = torch.randn(weight.shape[0])
        dense = dequantize(weight)
        bound = 1e-5 * (x.abs() @ dense.abs().T).max()
        torch.testing.assert_close(quantized.quantized_linear(x, weight, bias, roles(path == "prompt")),
                                   x @ dense.T + bias, atol=float(bound), rtol=0)


def test_the_avx2_kernel_is_built_on_this_machine():
    """The suite runs on AVX2 machines; the fallback must not silently replace the kernel there."""
    flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    if " avx2" not in flags:
        pytest.skip("no AVX2 on this CPU: the PyTorch fallback is what runs")
    assert ops.available()
