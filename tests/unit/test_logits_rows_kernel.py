"""The logits layer's kernel (float32 activations x 8-bit rows-layout codes, rows_avx512.cpp) takes each
group's scales from eight converted at once: bit for bit the AVX2 kernel's results, where the groups are
a whole number of eights and where a few are left over (SmolLM2's 576 inputs: 18 groups of 32), for
float16 and float32 scales, groups of 32 and 16, every row blocking and 1 or 2 threads; so do it and its 6-bit
twin (rows6_avx512.cpp, which turns each code into a float by a byte shuffle and the exponent trick:
pairs_avx512.h) for every code value at every input position, zeros' signs included."""

from __future__ import annotations

import pytest
import torch
from kernel_isas import avx512_gives_the_avx2_bits, needs_avx512, on_both_isas, rows_and_threads

from fastdecode.layers import ops, six_bit
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


# 6 bits: one super-block, and past the prefetch distance (16 super-blocks); 8 bits: SmolLM2's 18 groups of 32
@pytest.mark.parametrize("bits, K", [(6, 256), (6, 4352), (8, 576), (8, 512)])
def test_every_code_gives_the_avx2_bits(bits, K):
    N, group, values = 13, 16 if bits == 6 else 32, 1 << bits  # 3 blocks of 4 outputs and one to the AVX2 kernel
    inputs, outputs = torch.arange(K).view(1, K), torch.arange(N).view(N, 1)
    codes = ((inputs + 5 * outputs) % values - values // 2).to(torch.int8)  # [N, K]: every code at every position
    codes[6] = 0  # an output of zero codes only: the sign of its zero products and sums
    generator = torch.Generator().manual_seed(K)
    scale = torch.rand(N, K // group, generator=generator) * 0.01 + 1e-3
    weight = (QuantizedWeight("Q6_K", 6, 16, six_bit.pack(codes), scale, None) if bits == 6
              else QuantizedWeight("Q8_0", 8, 32, codes, scale.half(), None))
    x = torch.randn(9, K, generator=generator)
    for M, threads in rows_and_threads((1, 2, 3, 8, 9)):
        wide, narrow = on_both_isas(
            lambda M=M, threads=threads: ops.qmatmul(x[:M], weight.codes, weight.scale, None, bits, group, threads, 32, N))
        assert torch.equal(wide.view(torch.int32), narrow.view(torch.int32)), (K, M, threads)
        assert torch.equal(wide[:, 6].view(torch.int32), torch.zeros(M, dtype=torch.int32))  # +0, as the AVX2 kernel
