"""The logits layer's kernel (float32 activations x 8-bit rows-layout codes, rows_avx512.cpp) takes each
group's scales from eight converted at once: bit for bit the AVX2 kernel's results, where the groups are
a whole number of eights and where a few are left over (SmolLM2's 576 inputs: 18 groups of 32), for
float16 and float32 scales, groups of 32 and 16, every row blocking and 1 or 2 threads."""

from __future__ import annotations

import pytest
import torch
from kernel_isas import avx512_gives_the_avx2_bits, needs_avx512, rows_and_threads

from fastdecode.layers import ops
from fastdecode.layers.quantized import QuantizedWeight

pytestmark = [pytest.mark.skipif(not ops.available(), reason="the extension's kernels are not built here"),
              needs_avx512]


@pytest.mark.parametrize("K, group, scale_dtype", [(576, 32, torch.float16), (608, 32, torch.float16),
                                                   (96, 32, torch.float16), (512, 32, torch.float32),
                                                   (160, 16, torch.float32), (416, 16, torch.float16)])
def test_the_avx512_logits_kernel_gives_the_avx2_bits(K, group, scale_dtype):
    N = 37  # 9 blocks of 4 outputs and one left to the AVX2 kernel
    generator = torch.Generator().manual_seed(K + group)
    codes = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=generator)
    scale = (torch.rand(N, K // group, generator=generator) * 0.01 + 1e-3).to(scale_dtype)
    weight = QuantizedWeight("Q8_0", 8, group, codes, scale, None)
    x = torch.randn(9, K, generator=generator)
    avx512_gives_the_avx2_bits(
        lambda M, threads: ops.qmatmul(x[:M], weight.codes, weight.scale, None, 8, group, threads, 32, N),
        rows_and_threads((1, 2, 3, 5, 8, 9)))
