"""Valid raw GGUF blocks of random weights, for tests of the repacker and the kernels (no checkpoint)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize

K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# offsets of the float16 super-scales in a K-quant block: d and dmin (Q4_K, Q5_K), d (Q6_K)
K_SCALE_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def random_blocks(qtype: QT, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Valid raw blocks [N, bytes per row] of a [N, K] tensor, weights of magnitude ~0.1.

    gguf-py cannot quantize K-quants, so those are random bytes (every bit pattern of codes and
    6-bit sub-scales is a valid block) with the float16 super-scales set small and finite."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return gguf_quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-4, 4e-4, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)
