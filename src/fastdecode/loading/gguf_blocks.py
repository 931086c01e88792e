"""GGUF quantized blocks -> ``QuantizedWeight`` (codes + scales + mins), once at load, without float32.

Every supported type is an affine map per group of inputs, w = scale * code + min, so each repacks
into the kernels' one format *exactly* (the decoded weights are bit-identical to ``gguf.quants``'
dequantization; only the order of the sums in a product differs):

  type   file bits/w  group  code            scale (dtype)            min             kernel bits/w
  Q8_0   8.5          32     int8 q          d (f16)                  none            8 + 0.5
  Q4_0   4.5          32     nibble q        d (f16)                  -8 d (f16)      4 + 1
  Q4_1   5.0          32     nibble q        d (f16)                  m (f16)         4 + 1
  Q5_0   5.5          32     int8 q - 16     d (f16)                  none            8 + 0.5
  Q4_K   4.5          32     nibble q        d * sc (f32, exact)      -dmin * m (f32)  4 + 2
  Q5_K   5.5          32     int8 q (0..31)  d * sc (f32)             -dmin * m (f32)  8 + 2
  Q6_K   6.5625       16     int8 q - 32     d * sc (f32)             none            8 + 2

(-8 d is exact in f16: a power-of-two multiple; d * sc is an 11-bit by 6- or 8-bit integer product,
exact in float32's 24-bit mantissa.) Q5_0, Q5_K and Q6_K are held as int8 codes: exact, but they read
about 1.5-1.8x the file's bytes per token; Q4_* read 1.1-1.3x (float16/float32 scales beside nibbles).
"""

from __future__ import annotations

import numpy as np
import torch

from ..layers.quantized import QuantizedWeight

QK_K = 256


def _f16(column: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] of little-endian float16 -> float16 [...]."""
    return np.ascontiguousarray(column).view(np.float16)[..., 0]


def _nibbles_to_kernel(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, K] (0..15) -> bytes [N, K/2] in the kernels' order (per 32: j low, j + 16 high)."""
    N, K = codes.shape
    groups = codes.reshape(N, K // 32, 2, 16)  # [N, K/32, half, 16]
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(N, K // 2)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K 12 packed bytes [B, 12] -> 6-bit (sub-scale, sub-min) [B, 8] each (ggml's get_scale_min_k4)."""
    d, m, m_d = np.split(scales.reshape(-1, 3, 4), 3, axis=-2)  # each [B, 1, 4]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


def _q8_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 34)  # [N, K/32, d(2) + 32 codes]
    codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(N, K)
    return 8, 32, codes, _f16(blocks[..., :2]), None


def _q4_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 18)  # [N, K/32, d(2) + 16 nibble bytes]
    d = _f16(blocks[..., :2])
    return 4, 32, np.ascontiguousarray(blocks[..., 2:]).reshape(N, K // 2), d, (d * np.float16(-8))


def _q4_1(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 20)  # [N, K/32, d(2) + m(2) + 16 nibble bytes]
    codes = np.ascontiguousarray(blocks[..., 4:]).reshape(N, K // 2)
    return 4, 32, codes, _f16(blocks[..., :2]), _f16(blocks[..., 2:4])


def _q5_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 22)  # [N, K/32, d(2) + qh(4, bit j: 5th bit of element j) + 16 nibble bytes]
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [N, K/32, 32]
    qs = blocks[..., 6:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32]: elements j, then j + 16
    codes |= np.left_shift(high, 4, out=high)
    codes -= 16  # 0..31 -> -16..15, as int8 below (uint8 wraps to the same bytes)
    return 8, 32, codes.view(np.int8).reshape(N, K), _f16(blocks[..., :2]), None


def _k_affine(blocks: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per-32 (scale, min) float32 [N, K/32]."""
    d = _f16(blocks[:, :2]).astype(np.float32)[:, None]  # [B, 1]
    dmin = _f16(blocks[:, 2:4]).astype(np.float32)[:, None]
    sc, mn = _k_scale_min(blocks[:, 4:16])  # [B, 8] each
    return (d * sc).reshape(N, K // 32), (-dmin * mn).reshape(N, K // 32)


def _q4_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 144)  # [B, d(2) dmin(2) scales(12) qs(128)]
    scale, mins = _k_affine(blocks, N, K)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(N, K)  # per 64: 32 low nibbles, then 32 high nibbles
    return 4, 32, _nibbles_to_kernel(codes), scale, mins


def _q5_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 176)  # [B, d(2) dmin(2) scales(12) qh(32) qs(128)]
    scale, mins = _k_affine(blocks, N, K)
    ql = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 1) << 4)  # [B, 8, 32], 0..31
    return 8, 32, codes.reshape(N, K).astype(np.int8), scale, mins


def _q6_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 210)  # [B, ql(128) qh(64) scales(16, int8) d(2)]
    d = _f16(blocks[:, 208:]).astype(np.float32)[:, None]  # [B, 1]
    scale = (d * blocks[:, 192:208].view(np.int8)).reshape(N, K // 16)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 3).reshape(-1, 8, 32) << 4)  # [B, 8, 32], 0..63
    return 8, 16, (q.astype(np.int8) - 32).reshape(N, K), scale, None


REPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
             "Q6_K": _q6_k}


def repack(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
    """Raw block bytes of a [N, K] GGUF tensor (numpy order) -> QuantizedWeight [N, K]."""
    N, K = shape
    bits, group, codes, scale, mins = REPACKERS[type_name](raw, N, K)
    return QuantizedWeight(
        type_name, bits, group, torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(scale)),
        None if mins is None else torch.from_numpy(np.ascontiguousarray(mins)),
    )
