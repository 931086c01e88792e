"""The absolute bits of prompt rows' exact products (layers/exact_matmul.cpp): the other tests compare the kernel
with itself (AVX-512 with AVX2, tiles with rows, a chunk with the whole prompt), which a change of both kernels'
arithmetic alike would pass; this one pins a digest of its outputs on fixed inputs, so a faster kernel (blocking,
passes, buffers, prefetching) shows it kept every (row, output)'s FMAs and lane tree."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from kernel_isas import on_both_isas

from fastdecode.layers import ops
from fastdecode.loading.gguf_blocks import repack

pytestmark = pytest.mark.skipif("not ops.available()", reason="no AVX2 kernel on this machine")

# offsets of each block's float16 scales: d (Q8_0, Q6_K), d and dmin (Q4_K)
SCALE_OFFSETS = {QT.Q8_0: (0,), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
# (format, inputs, outputs, row counts): Q8_0 tiled at SmolLM2's width (one pass of 576 inputs, pieces of 32
# outputs, the last one 8), Q4_K tiled at Qwen's (3 passes of 512, pieces of 64, 1032 = 16 x 64 + 8), Q6_K in
# rows (the dequantize op's pieces); rows: the AVX-512 kernel's plain path (< 12) and its interleaved pairs over
# chunks of 48 (6-row blocks, a last block of 1-5)
CASES = [(QT.Q8_0, 576, 200, (5, 61)), (QT.Q4_K, 1536, 1032, (7, 50)), (QT.Q6_K, 512, 40, (3, 13))]
# SHA-256 of the outputs below (float32 bytes, in CASES order, each row count on 1 then 2 threads): computed by
# the kernel as of commit 5619467, before the exact-12 changes.
PINNED_DIGEST = "e5115cc57368fcc80d4e616802a7b43bf98064036477436e39e055c05705694a"


def integer_floats(count: int, salt: int) -> torch.Tensor:
    """``count`` floats in [-1, 1) with full 24-bit mantissas from integers alone (no RNG whose stream could
    change): their products round, so a different order of the sums gives other bits."""
    i = torch.arange(count, dtype=torch.int64)
    return (((i * 2654435761 + salt * 40503) % (1 << 24)) - (1 << 23)).float() / (1 << 23)


def integer_blocks(qtype: QT, outputs: int, inputs: int) -> np.ndarray:
    """Raw GGUF blocks [outputs, bytes per row] from integers (every code byte pattern is valid), the float16
    scales set to small finite values."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = outputs * inputs // block_size
    i = np.arange(blocks * type_size, dtype=np.int64)
    raw = ((i * 131 + (i >> 7) * 17) % 256).astype(np.uint8).reshape(blocks, type_size)
    for n, offset in enumerate(SCALE_OFFSETS[qtype]):
        scale = ((np.arange(blocks) * 7 + n) % 13 + 1).astype(np.float16) * np.float16(1e-4 if qtype != QT.Q8_0 else 1e-3)
        raw[:, offset:offset + 2] = scale[:, None].view(np.uint8)
    return raw.reshape(outputs, -1)


def exact(x: torch.Tensor, weight, threads: int) -> torch.Tensor:
    return ops.exact_qmatmul(x, weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                             weight.outputs)


def test_the_exact_products_keep_their_bits():
    """Every case's outputs on AVX-512 (where the CPU has it) and AVX2: equal, and their digest the pinned one."""
    digest = hashlib.sha256()
    for qtype, inputs, outputs, row_counts in CASES:
        weight = repack(qtype.name, integer_blocks(qtype, outputs, inputs), (outputs, inputs), tile=True)
        x = integer_floats(max(row_counts) * inputs, salt=inputs).view(-1, inputs)  # [rows, inputs]
        for M in row_counts:
            for threads in (1, 2):
                fast, plain = on_both_isas(lambda rows=x[:M], threads=threads, weight=weight: exact(rows, weight, threads))
                assert torch.equal(fast, plain), (qtype.name, M, threads)
                digest.update(fast.numpy().tobytes())
    assert digest.hexdigest() == PINNED_DIGEST, digest.hexdigest()
