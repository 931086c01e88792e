"""How the kernels group the rows of a beam step, pinned bit for bit to each row computed alone:

- the logits layer's float32-activation kernel (qmatmul.cpp's float_rows, rows_avx512.cpp's pairs) runs
  the last 1-7 rows of a product as one block (a beam-5 step's 5 rows: the codes decoded once, not for 4
  rows then 1): each row's operations are the same whatever its block;
- the cross-attention (cross_attention.cpp) runs a source's queries (a window's beams) in tiles, each tile
  over as many of the head's dims at once as its registers hold (one query: 64): each query's scores and
  sums are its own, in key order, whatever its tile and dims grouping;
- the tiled int8-activation kernel runs a beam-5 step's 5 rows as one block.
Each is compared with the same op on one row (one query) at a time, on 1 and 2 threads.
"""

from __future__ import annotations

import pytest
import torch

from fastdecode.layers import ops
from fastdecode.layers.quantized import for_logits, quantize_matrix

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_logits_rows_in_blocks_of_any_size_equal_each_row_alone(kind):
    g = torch.Generator().manual_seed(4)
    weight = for_logits(quantize_matrix(torch.randn(203, 96, generator=g), kind, tile=False))  # a rows-layout head
    x = torch.randn(15, 96, generator=g)  # 8 + 7 rows

    def product(rows: torch.Tensor, threads: int) -> torch.Tensor:
        return ops.qmatmul(rows.contiguous(), weight.codes, weight.scale, weight.mins, weight.bits, weight.group,
                           threads, 32, weight.outputs)

    alone = torch.cat([product(x[m : m + 1], 1) for m in range(15)])  # [15, 203]
    for count in range(1, 16):
        for threads in (1, 2):
            assert torch.equal(product(x[:count], threads), alone[:count]), (count, threads)
    dense = ops.dequantize(weight.codes, weight.scale, weight.mins, weight.bits, weight.group, 1, weight.outputs)
    torch.testing.assert_close(alone, x @ dense.T, atol=1e-4, rtol=1e-4)  # [N, K]: the exact float product


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 24, 72])
def test_cross_attention_query_tiles_equal_each_query_alone(dtype, D):
    g = torch.Generator().manual_seed(D)
    B, H, S = 2, 3, 45
    lengths = torch.tensor([45, 19])
    keys = torch.randn(B, H, S, D, generator=g).to(dtype)
    values = torch.randn(B, H, S, D, generator=g).to(dtype)
    for T in (2, 4, 5, 6, 7, 11):
        q = torch.randn(1, H, B * T, D, generator=g)[0].unflatten(1, (B, T)).transpose(0, 1)  # [B, H, T, D] strided
        alone = torch.cat([ops.cross_attention(q[:, :, t : t + 1], keys, values, lengths, 0.3) for t in range(T)], 2)
        for threads in (1, 2):
            assert torch.equal(ops.cross_attention(q, keys, values, lengths, 0.3, threads), alone), (T, threads)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_tiled_int8_rows_in_a_block_of_five_equal_each_row_alone(kind):
    """The tiled int8-activation kernel runs a beam-5 step's 5 rows as one block (qtiles.cpp's wide_rows<5>:
    the codes loaded and summed once for 5 rows, not for 4 then 1): each row's bits are its own, on both
    instruction sets (an odd tile count: the last tile on the AVX2 kernel, 4 rows then 1), 1 and 2 threads."""
    g = torch.Generator().manual_seed(5)
    weight = quantize_matrix(torch.randn(8 * 13, 96, generator=g), kind)  # 13 tiles of 8 outputs
    x = torch.randn(13, 96, generator=g)  # 8 + 5 rows

    def product(rows: torch.Tensor, threads: int) -> torch.Tensor:
        return ops.qmatmul(rows.contiguous(), weight.codes, weight.scale, weight.mins, weight.bits, weight.group,
                           threads, 8, weight.outputs)

    wide = ops.set_avx512()
    try:
        for avx512 in sorted({False, wide}):
            ops.set_avx512(avx512)
            alone = torch.cat([product(x[m : m + 1], 1) for m in range(13)])  # [13, 104]
            for count in (5, 13):
                for threads in (1, 2):
                    assert torch.equal(product(x[:count], threads), alone[:count]), (avx512, count, threads)
    finally:
        ops.set_avx512(wide)
