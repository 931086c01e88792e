"""The float32 kernel for generated rows (layers/fmatmul.cpp, ``float_matmul``) and how ``linear`` uses it.

Every output is summed in one fixed order (FMA chains over segments of 64 inputs, added in order): the
tests pin it against a float64 product (summation-order error only) and check that a row's bits never
depend on the other rows of its product (batch 1 splits segments, more rows split columns), the thread
count or how its work is split, and that ``linear`` gives prompt
rows the GEMM (or the kernel, where the kernel choice says so) and generated rows the kernel, each row as it
would be alone in its role."""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.nn.functional as F
from kernel_isas import avx512_gives_the_avx2_bits, needs_avx512, rows_and_threads

from fastdecode.layers import gemm, ops
from fastdecode.layers.float_rows_choice import DEFAULT_IN_PLACE_ROWS
from fastdecode.layers.linear import linear as linear_with
from fastdecode.layers.products import KernelChoice, Products

needs_kernel = pytest.mark.skipif("not ops.available()", reason="no AVX2 extension on this machine")


def float_matmul(x, w, bias, threads, limits=DEFAULT_IN_PLACE_ROWS):
    """The op with the in-place row limits of a reference KernelChoice (layers/float_rows_choice.py)."""
    return ops.float_matmul(x, w, bias, threads, *limits)


def roles(is_prompt: bool | list[bool], kernels: KernelChoice | None = None) -> Products:
    return Products.of_rows(is_prompt, torch.get_num_threads(), kernels=kernels or KernelChoice())


def linear(x, weight, bias=None, activation=None, products=None):
    """``linear`` with generated rows unless ``products`` says otherwise."""
    return linear_with(x, weight, bias, activation, products=products or roles(False))

# (K, N): the decode shapes of a small Llama (Q/K/V, O, MLP), odd sizes (a masked last vector, K not a
# multiple of 4, N below 8), a wide matrix split into many column chunks, and several segments of 64 inputs
# with a partial last one
SHAPES = [(64, 96), (96, 40), (37, 13), (5, 3), (48, 1100), (200, 72), (136, 1100)]


def weights(K: int, N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, N, generator=g), torch.randn(N, generator=g), torch.randn(40, K, generator=g)


def bound(x: torch.Tensor, w: torch.Tensor) -> float:
    """Summation-order error bound: K ulps of the largest |x| @ |w| term sum (float32)."""
    return float(x.shape[1] * 2**-23 * (x.abs() @ w.abs()).max())


@needs_kernel
@pytest.mark.parametrize("K, N", SHAPES)
def test_kernel_is_the_float_product_up_to_summation_order(K, N):
    w, bias, x = weights(K, N, seed=K + N)
    op = float_matmul
    for M in (1, 2, 3, 5, 8, 9, 17, 40):
        exact = x[:M].double() @ w.double()
        torch.testing.assert_close(op(x[:M], w, None, 1).double(), exact, atol=bound(x[:M], w), rtol=0)
        torch.testing.assert_close(op(x[:M], w, bias, 2).double(), exact + bias.double(),
                                   atol=bound(x[:M], w) + 1e-6 * float(bias.abs().max()), rtol=0)


@needs_kernel
@pytest.mark.parametrize("K, N", SHAPES)
def test_a_row_gets_the_same_bits_at_every_row_count_thread_count_and_position(K, N):
    """Rows are grouped by 8, 4, 2 and 1 and columns cut into chunks the threads claim: a row alone and the
    same row among others (any count, any position) must be the same bits, and the bias one more add."""
    w, bias, x = weights(K, N, seed=7)
    op = float_matmul
    alone = torch.cat([op(x[m : m + 1], w, bias, 1) for m in range(40)])
    for M in (2, 3, 7, 8, 13, 16, 40):
        for threads in (1, 2):
            assert torch.equal(op(x[:M], w, bias, threads), alone[:M]), (M, threads)
    shuffled = torch.randperm(40, generator=torch.Generator().manual_seed(1))
    assert torch.equal(op(x[shuffled], w, bias, 2), alone[shuffled])
    assert torch.equal(op(x[:5], w, bias, 1), op(x[:5], w, None, 1) + bias)


@needs_kernel
@pytest.mark.parametrize("K, N", [(1536, 576), (200, 32776)])
def test_one_row_partial_sums_added_while_the_pieces_run_are_the_in_order_additions(K, N):
    """At batch 1 the segments' partial rows are added into the output by whichever thread finishes a piece,
    in segment order (fmatmul.cpp's add_ready): on two threads, call after call (the pieces finishing in
    varying order), a row is the bits of the serial run and of the several-rows path's in-order additions;
    24 segments in one column block, and 4 segments in two blocks (the second 8 columns wide)."""
    w, bias, x = weights(K, N, seed=11)
    op = float_matmul
    row = x[:1].contiguous()
    serial = op(row, w, bias, 1)
    assert torch.equal(op(x[:2], w, bias, 1)[:1], serial)  # the several-rows path adds in the same order
    for _ in range(200 if K * N < 2**21 else 20):
        assert torch.equal(op(row, w, bias, 2), serial)
        assert torch.equal(op(row, w, None, 2) + bias, serial)


@needs_kernel
@needs_avx512
@pytest.mark.parametrize("K, N", SHAPES + [(768, 3072), (70, 9000), (70, 16384), (3072, 100)])
def test_the_avx512_kernel_for_several_rows_gives_the_avx2_bits(K, N):
    """Several rows on AVX-512 (fmatmul_avx512.cpp: 8 rows x 48 columns of sums in registers, 3, 5, 6 or 7
    rows as one group; 9 to 64 rows (32 where w's rows lie 4 KiB apart) as groups of 8 and one of the rest taking
    turns over runs of w's rows read in place; more rows (a prompt) from a packed copy of a block of columns for
    all K rows, each group of 8 rows, then the last 1-7, through the whole block) and on AVX2 (sums in L1): every
    output the same operations, so the same bits, at row counts that straddle the row groups, masked column
    tails, column chunks of several packed blocks (70 x 9000: chunks of 1152 columns; 768 x 3072: blocks of 96
    columns), one pass per block (3072 x 100), rows 64 KiB apart (70 x 16384: 9 to 16 rows prefetched into L3,
    further ahead) and 1 or 2 threads."""
    w, bias, x = weights(K, N, seed=K * 3 + N)
    x = torch.cat([x, x.flip(0) * 0.5, x[:20] - 1])  # [100, K]: a prompt chunk's rows
    avx512_gives_the_avx2_bits(lambda M, threads: float_matmul(x[:M], w, bias, threads),
                               rows_and_threads((2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 32, 33, 40, 64,
                                                 65, 100)))


def exact_floats(count: int, salt: int) -> torch.Tensor:
    """``count`` floats of 24 significant bits in (-1, 1) from integers alone (no RNG whose stream could change):
    products and sums that round, so that another order of the additions gives other bits."""
    i = torch.arange(count, dtype=torch.int64)
    return (((i * 2654435761 + salt * 40503) % (1 << 24)) - (1 << 23)).double().div(1 << 23).float()


# The outputs below, hashed (SHA-256 of their float32 bytes): computed by the kernel as of commit 5619467, before
# the 9-16-row kernel was retiled. The row-alone and AVX2 comparisons above would not see every path change
# together; the greedy tokens of float32 models' goldens were taken with these bits.
PINNED_DIGEST = "14e019d8d6d5bcd56a7f8ae13ec0cbddb3924e87105cedb2b9c8b7320df61791"


# The in-place row limits (layers/float_rows_choice.py): the default's; every row count past 8 from packed copies of w;
# every one up to 64 read in place (768 x 3072's 33 to 64 rows too, which the default packs). The limit chooses the
# speed, never the bits.
FORCED_LIMITS = [DEFAULT_IN_PLACE_ROWS, (8, 8), (64, 64)]


@needs_kernel
@pytest.mark.parametrize("limits", FORCED_LIMITS)
def test_the_kernel_keeps_its_bits_at_9_to_16_rows(limits):
    """A serving step's 9 to 16 rows (and 8 and 17 beside them) on decode shapes of the embedded model's float32
    products (Q/K/V 576 x 960, gate/up 576 x 3072 whose rows lie 12 KiB apart, down 1536 x 576) and a masked
    tail (200 x 100), with a bias, on 1 and 2 threads, whatever the in-place row limits: the digest of every
    output."""
    digest = hashlib.sha256()
    for K, N in [(576, 960), (576, 3072), (1536, 576), (200, 100)]:
        w, bias, x = exact_floats(K * N, 1).view(K, N), exact_floats(N, 2), exact_floats(17 * K, 3).view(17, K)
        for M in range(8, 18):
            out = float_matmul(x[:M], w, bias, 1, limits)
            assert torch.equal(float_matmul(x[:M], w, bias, 2, limits), out), (K, N, M)
            digest.update(out.numpy().tobytes())
    assert digest.hexdigest() == PINNED_DIGEST, digest.hexdigest()


# The outputs below, hashed: computed by the kernel as of commit 2e2f151, when every row group past 16 rows read a packed
# copy of each block of w (now up to 64 rows, 32 where w's rows lie a multiple of 4 KiB apart, read w in place).
PINNED_DIGEST_PAST_16 = "24a9dec149d16b4894d06c635661463199fb203e814719ad6f4a94b1ba77fdf2"


@needs_kernel
@pytest.mark.parametrize("limits", FORCED_LIMITS)
def test_the_kernel_keeps_its_bits_past_16_rows(limits):
    """A beam step's 32 rows (8 sources x beam 4) and the row counts around the in-place groups' limits, on bart-base's
    decode shapes (768 x 2304: rows 9 KiB apart; 768 x 3072: 12 KiB apart, in place up to 32 rows only), a wide matrix
    of odd width in several column chunks (96 x 20001), rows 64 KiB apart (70 x 16384: prefetched into L3) and a
    masked tail (200 x 100), with a bias, on 1 and 2 threads, whatever the in-place row limits: the digest of every
    output."""
    digest = hashlib.sha256()
    for K, N in [(768, 2304), (768, 3072), (96, 20001), (70, 16384), (200, 100)]:
        w, bias, x = exact_floats(K * N, 4).view(K, N), exact_floats(N, 5), exact_floats(65 * K, 6).view(65, K)
        for M in (17, 24, 31, 32, 33, 40, 63, 64, 65):
            out = float_matmul(x[:M], w, bias, 1, limits)
            assert torch.equal(float_matmul(x[:M], w, bias, 2, limits), out), (K, N, M)
            digest.update(out.numpy().tobytes())
    assert digest.hexdigest() == PINNED_DIGEST_PAST_16, digest.hexdigest()


@needs_kernel
def test_kernel_rejects_what_it_cannot_read():
    op = float_matmul
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="inputs"):
        op(torch.randn(2, 9), w, None, 1)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(2, 16), w.t(), None, 1)
    with pytest.raises(RuntimeError, match="bias"):
        op(torch.randn(2, 8), w, torch.randn(15), 1)
    assert op(torch.randn(0, 8), w, None, 1).shape == (0, 16)
    for limits in ((7, 32), (64, 65)):
        with pytest.raises(RuntimeError, match="rows read in place must be 8 to 64"):
            op(torch.randn(2, 8), w, None, 1, limits)


@needs_kernel
def test_linear_gives_generated_rows_the_kernel_and_prompt_rows_the_gemm():
    """A canonical [in, out] buffer seen as [out, in] (what models hold): decode rows through the kernel,
    prompt rows (``Products.roles``) through the choice's GEMM, and a mixed step each part as in its role alone."""
    w, bias, x = weights(64, 96, seed=3)
    weight = w.t()  # [out, in] view of the [in, out] buffer
    with torch.no_grad():
        generated = linear(x.view(5, 8, 64), weight, bias)  # [5, 8, 96]
        assert generated.shape == (5, 8, 96)
        assert torch.equal(generated.reshape(40, 96), float_matmul(x, w, bias, 1))
        prompt = linear(x, weight, bias, products=roles(True))
        assert torch.equal(prompt, gemm.gemm(x, weight, bias, None, torch.get_num_threads(), KernelChoice().float_gemm))
        torch.testing.assert_close(prompt, generated.reshape(40, 96), atol=1e-4, rtol=0)
        is_prompt = [i % 3 == 0 for i in range(40)]
        prompt_rows = [i for i, p in enumerate(is_prompt) if p]
        mixed = linear(x, weight, bias, activation="relu", products=roles(is_prompt))
        for i in (1, 2, 38):  # generated rows: as alone
            assert torch.equal(linear(x[i : i + 1], weight, bias, activation="relu")[0], mixed[i]), i
        # prompt rows: as the same rows' GEMM
        assert torch.equal(linear(x[prompt_rows], weight, bias, activation="relu", products=roles(True)),
                           mixed[prompt_rows])
        # the logits layer: other rows than the roles'
        assert torch.equal(linear(x[:3], weight, bias, products=roles(is_prompt[:39] + [False])),
                           generated.reshape(40, 96)[:3])


@needs_kernel
def test_prompt_rows_take_the_kernel_where_the_choice_says_so(monkeypatch):
    """``KernelChoice(prompt_kernel=True)`` (layers/gemm_choice.py chooses it at load where the kernel runs prompt
    rows about as fast as the GEMM): prompt rows through the kernel too, so a prompt, a decode step and a step
    mixing both give every row the bits of that row alone, and no GEMM runs;
    except a product whose activation the GEMM fuses (oneDNN's ReLU), whose prompt rows keep the GEMM."""
    w, bias, x = weights(64, 96, seed=6)
    weight = w.t()  # [out, in] view of the [in, out] buffer
    alone = torch.cat([float_matmul(x[m : m + 1], w, bias, 1) for m in range(40)])  # [40, 96]
    choice = KernelChoice(prompt_kernel=True)
    with torch.no_grad():
        fused = linear(x, weight, bias, activation="relu", products=roles(True, choice))
        assert torch.equal(fused, linear(x, weight, bias, activation="relu", products=roles(True)))  # the GEMM's
        monkeypatch.setattr("fastdecode.layers.linear.gemm", lambda *args: pytest.fail("the GEMM ran"))
        for is_prompt in (True, False, [i % 3 == 0 for i in range(40)]):
            out = linear(x.view(5, 8, 64), weight, bias, activation="silu", products=roles(is_prompt, choice))
            assert torch.equal(out, F.silu(alone).view(5, 8, 96)), is_prompt
        assert torch.equal(linear(x, weight, bias, activation="relu", products=roles(True, KernelChoice(
            float_gemm="mkl", prompt_kernel=True))), F.relu(alone))  # MKL fuses nothing: the kernel
        held = w.half().float()  # a float16-held matrix: the kernel widens it, prompt rows too
        assert torch.equal(linear(x, held.half().t(), bias, products=roles(True, choice)),
                           linear(x, held.t(), bias, products=roles(False)))


def test_without_the_extension_or_for_other_layouts_linear_is_f_linear(monkeypatch):
    """No extension (forced), an [out, in] buffer, or autograd on: the PyTorch path, as before."""
    w, bias, x = weights(64, 96, seed=4)
    expected = F.linear(x, w.t(), bias)
    monkeypatch.setitem(ops._LOADED, "ops", None)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w.t(), bias), expected, atol=1e-4, rtol=0)
    monkeypatch.undo()
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w.t().contiguous(), bias), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(linear(x, w.t(), bias), expected, atol=1e-4, rtol=0)


@needs_kernel
@pytest.mark.parametrize("K, N", SHAPES + [(384, 1100)])
def test_a_float16_held_weight_gives_the_float32_bits(K, N):
    """A float32 matrix whose values are float16 values, held in float16 (models/whisper.py's
    hold_in_half): the kernel widens each weight as it loads it, so every row count, thread count and
    ISA (AVX-512 several-row passes, AVX2 sums in L1, the one-row segments) gives the float32 buffer's bits."""
    w, bias, x = weights(K, N, seed=K + 7 * N)
    half = w.half()
    exact = half.float()  # the float32 model's values
    avx512 = ops.set_avx512()
    try:
        for isa in {avx512, False}:
            ops.set_avx512(isa)
            for M in (1, 2, 3, 5, 8, 9, 16, 17, 32, 40):
                for threads in (1, 2):
                    for b in (None, bias):
                        assert torch.equal(float_matmul(x[:M], half, b, threads),
                                           float_matmul(x[:M], exact, b, threads)), (isa, M, threads)
    finally:
        ops.set_avx512(avx512)


@needs_kernel
def test_linear_runs_a_float16_held_weight_as_its_float32_values():
    """Generated rows through the kernel on the float16 buffer, prompt rows through the GEMM on the
    widened float32 values, a mixed step each part so: all the float32 weight's bits."""
    w, bias, x = weights(64, 96, seed=5)
    exact = w.half().float()
    held, weight = exact.half().t(), exact.t()  # [out, in] views of the [in, out] buffers
    is_prompt = [i % 3 == 0 for i in range(40)]
    with torch.no_grad():
        for products in (roles(False), roles(True), roles(is_prompt)):
            assert torch.equal(linear(x, held, bias, activation="gelu", products=products),
                               linear(x, weight, bias, activation="gelu", products=products))


def test_a_tied_table_looks_its_rows_up_as_f_embedding():
    """``embed`` gathers a tied table (the [V, C] view of a [C, V] buffer) along the buffer's rows: the same
    values as F.embedding, whatever the token shape, repeats and order; a contiguous table as before."""
    from fastdecode.layers.quantized import embed

    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(24, 301, generator=g)  # [C, V]
    for tokens in (torch.tensor([[5, 300, 5, 0], [7, 7, 1, 2]]), torch.tensor([9]), torch.tensor([[4], [250]]),
                   torch.randint(0, 301, (3, 64), generator=g)):
        for table in (buffer.t(), buffer.t().contiguous()):
            rows = embed(tokens, table)
            assert rows.shape == (*tokens.shape, 24) and rows.is_contiguous()
            assert torch.equal(rows, F.embedding(tokens, table))
