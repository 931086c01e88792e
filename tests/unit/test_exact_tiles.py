"""Prompt rows' exact products on the tiled layout (layers/exact_matmul.cpp): each piece of a tiled weight is
decoded straight into the thread's buffer (qtiles.cpp's tiled_dequantize_range, the dequantize op's code
without its tensors), and must give the bits the rows layout of the same blocks gives through the dequantize op:
every output count of a partial last tile, the narrow and wide piece sizes, every row count of a short prompt,
1 and 2 threads, AVX-512 and AVX2."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kquant_gguf import random_blocks  # noqa: E402

from fastdecode.layers import ops  # noqa: E402
from fastdecode.layers.quantized import dequantize, tiled  # noqa: E402
from fastdecode.loading.gguf_blocks import repack  # noqa: E402

pytestmark = pytest.mark.skipif("not ops.available()", reason="no AVX2 kernel on this machine")


def _exact(x: torch.Tensor, weight, threads: int) -> torch.Tensor:
    return ops.exact_qmatmul(x, weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                             weight.outputs)


def _rows_and_tiles(qtype, outputs: int, inputs: int, seed: int):
    rows = repack(qtype.name, random_blocks(qtype, (outputs, inputs), seed=seed), (outputs, inputs))
    weight = tiled(rows)
    assert weight.is_tiled and not rows.is_tiled
    return rows, weight


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_0], ids=lambda q: q.name)
def test_a_tiled_weight_gives_the_rows_layout_bits_at_every_tail(qtype):
    """N = 1 .. 17 (every partial last tile, pieces of 32 outputs holding 1 to 3 tiles) and N = 41 (a piece past
    the first), M = 1 .. 9 rows: the tiled kernel's products equal the rows layout's, bit for bit."""
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(4))
    for outputs in [*range(1, 18), 41]:
        rows, weight = _rows_and_tiles(qtype, outputs, 96, seed=outputs)
        for M in range(1, 10):
            for threads in (1, 2):
                assert torch.equal(_exact(x[:M], weight, threads), _exact(x[:M], rows, threads)), (outputs, M, threads)


@pytest.mark.parametrize("outputs", [1029, 1032])
def test_wide_weights_in_pieces_of_64_give_the_rows_layout_bits(outputs):
    """Past 1024 outputs the pieces are 64 outputs (8 tiles); a last piece of 5 outputs (1029) or a whole tile
    (1032); 1, 5 and 12 rows (12: the AVX-512 kernel's interleaved pairs), 1 and 2 threads."""
    rows, weight = _rows_and_tiles(QT.Q4_1, outputs, 64, seed=7)
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(5))
    for M in (1, 5, 12):
        for threads in (1, 2):
            assert torch.equal(_exact(x[:M], weight, threads), _exact(x[:M], rows, threads)), (M, threads)


def test_the_avx2_kernels_give_the_same_bits_from_the_tiles():
    """AVX2 (switched) and AVX-512 read the same decoded buffer: the same bits, as the rows layout gives."""
    if not ops.set_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI (the AVX2 kernels serve it)")
    rows, weight = _rows_and_tiles(QT.Q4_1, 45, 128, seed=3)
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(6))
    try:
        fast = [_exact(x[:M], weight, 2) for M in range(1, 8)]
        assert not ops.set_avx512(False)
        for M in range(1, 8):
            assert torch.equal(_exact(x[:M], weight, 2), fast[M - 1]), M
            assert torch.equal(_exact(x[:M], rows, 1), fast[M - 1]), M
    finally:
        ops.set_avx512(True)


def test_the_decoded_tiles_are_the_dequantized_weights():
    """The product of identity rows reads the decoded weights back: exactly the dequantized values (the
    8-lane sums of one nonzero product each)."""
    rows, weight = _rows_and_tiles(QT.Q4_1, 13, 32, seed=9)
    eye = torch.eye(32)
    assert torch.equal(_exact(eye, weight, 1), dequantize(rows).T.contiguous())


@pytest.mark.parametrize("inputs", [640, 672, 1568])
def test_every_tile_edge_and_input_pass_gives_the_avx2_and_the_alone_bits(inputs):
    """The AVX-512 kernel walks groups of 4 output pairs (then single pairs, then an odd last output), passes of
    up to 640 inputs (672: two of 336; 1568: four of 392; the 8-lane sums carried between passes) and blocks of
    6 rows (a last block of 1-5) within chunks of 48 rows: at row counts straddling each edge, output counts
    leaving partial groups (13: 1 group, 2 pairs and 1 output; 30: 3 groups and 3 pairs; 41: a piece of 32 and
    one of 9), on 1 and 2 threads, every row gets the AVX2 kernel's bits (4 rows x 3 outputs, one pass) and the
    bits it gets in the 55-row product."""
    if not ops.set_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI (the AVX2 kernels serve it)")
    x = torch.randn(55, inputs, generator=torch.Generator().manual_seed(inputs))
    for outputs in (13, 30, 41):
        _, weight = _rows_and_tiles(QT.Q4_1, outputs, inputs, seed=outputs)
        together = _exact(x, weight, 1)
        for M in (1, 5, 6, 7, 11, 12, 13, 47, 48, 49, 55):
            for threads in (1, 2):
                try:
                    fast = _exact(x[:M], weight, threads)
                    assert not ops.set_avx512(False)
                    assert torch.equal(_exact(x[:M], weight, threads), fast), (outputs, M, threads)
                finally:
                    ops.set_avx512(True)
                assert torch.equal(fast, together[:M]), (outputs, M, threads)
                tail = _exact(x[M - 1 :].contiguous(), weight, threads)  # the rows from M - 1 on, alone
                assert torch.equal(tail, together[M - 1 :]), (outputs, M, threads)
