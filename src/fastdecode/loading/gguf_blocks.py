"""GGUF quantized blocks -> ``QuantizedWeight`` (codes + scales + mins), once at load, without float32.

Every supported type is an affine map per group of inputs, w = scale * code + min, so each repacks
into the kernels' one format *exactly* (the decoded weights are bit-identical to ``gguf.quants``'
dequantization; only the order of the sums in a product differs):

  type   file bits/w  group  code            scale (dtype)            min               kernel bits/w
  Q8_0   8.5          32     int8 q          d (f16)                  none              8 + 0.5
  Q4_0   4.5          32     nibble q        d (f16)                  -8 d (f16)        4 + 1
  Q4_1   5.0          32     nibble q        d (f16)                  m (f16)           4 + 1
  Q5_0   5.5          32     int8 q - 16     d (f16)                  none              8 + 0.5
  Q4_K   4.5          32     nibble q        d * sc (compact)         -dmin * m (compact) 4 + 0.625
  Q5_K   5.5          32     int8 q (0..31)  d * sc (compact)         -dmin * m (compact) 8 + 0.625
  Q6_K   6.5625       16     6-bit q - 32    d * sc (compact)         none              6 + 0.5625

(-8 d is exact in f16: a power-of-two multiple.) Compact K-quant scales (layers/kscales.py) are GGUF's own
6- or 8-bit sub-scale codes with the f16 super-scale (d, or -dmin for the mins) of each 256 inputs,
decoded in the kernels to d * sc: an 11-bit by 6- or 8-bit integer product, exact in float32's 24-bit
mantissa. Q6_K's codes stay packed as GGUF's ql/qh bytes (bits 6: layers/six_bit.h, unpacked in registers by
the kernels into the int8 codes q - 32): its weights read 1.0x the file's bytes. Q5_0 and Q5_K are held as
int8 codes: exact, but they read 1.45-1.6x the file's bytes per token; Q4_* read 1.0-1.1x. (Embedding tables and LM heads keep float32 K-quant scales: loading/gguf.py.)
"""

from __future__ import annotations

import numpy as np
import torch

from ..layers import kscales
from ..layers.quantized import TILE, QuantizedWeight, tiled

QK_K = 256


def _f16(column: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] of little-endian float16 -> float16 [...] (a view: copied by ``repack``)."""
    return column.view("<f2")[..., 0]


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


# Each repacker: raw blocks, N, K -> (bits, group, codes [N, K/group, code bytes per group], scale
# [N, K/group], mins or None). The plain types return views into the file's blocks; ``repack`` copies
# them once, straight into the layout the weight is kept in.
def _q8_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 34)  # [N, K/32, d(2) + 32 codes]
    return 8, 32, blocks[..., 2:].view(np.int8), _f16(blocks[..., :2]), None


def _q4_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 18)  # [N, K/32, d(2) + 16 nibble bytes]
    d = _f16(blocks[..., :2])
    return 4, 32, blocks[..., 2:], d, (d * np.float16(-8))


def _q4_1(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 20)  # [N, K/32, d(2) + m(2) + 16 nibble bytes]
    return 4, 32, blocks[..., 4:], _f16(blocks[..., :2]), _f16(blocks[..., 2:4])


def _q5_0(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(N, K // 32, 22)  # [N, K/32, d(2) + qh(4, bit j: 5th bit of element j) + 16 nibble bytes]
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # [N, K/32, 32]
    qs = blocks[..., 6:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, K/32, 32]: elements j, then j + 16
    codes |= np.left_shift(high, 4, out=high)
    codes -= 16  # 0..31 -> -16..15, as int8 below (uint8 wraps to the same bytes)
    return 8, 32, codes.view(np.int8), _f16(blocks[..., :2]), None


def _records(codes: np.ndarray, super_scale: np.ndarray, N: int, K: int) -> np.ndarray:
    """Sub-scale codes [B, S] and float16 super-scales [B] -> compact rows records int8 [N, K/256, S + 2]
    (layers/kscales.py)."""
    halves = np.ascontiguousarray(super_scale).view(np.int8).reshape(-1, 2)  # [B, 2] bytes
    return np.concatenate([codes.view(np.int8), halves], axis=-1).reshape(N, K // kscales.SUPER, -1)


def _k_affine(blocks: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> compact (scale, min) records [N, K/256, 10]: scale d * sc, min -dmin * m."""
    sc, mn = _k_scale_min(blocks[:, 4:16])  # [B, 8] each, 0..63
    return _records(sc, _f16(blocks[:, :2]), N, K), _records(mn, -_f16(blocks[:, 2:4]), N, K)


def _q4_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 144)  # [B, d(2) dmin(2) scales(12) qs(128)]
    scale, mins = _k_affine(blocks, N, K)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & 0x0F).reshape(N, K)  # per 64: 32 low nibbles, then 32 high nibbles
    return 4, 32, _nibbles_to_kernel(codes).reshape(N, K // 32, 16), scale, mins


def _q5_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 176)  # [B, d(2) dmin(2) scales(12) qh(32) qs(128)]
    scale, mins = _k_affine(blocks, N, K)
    ql = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 1) << 4)  # [B, 8, 32], 0..31
    return 8, 32, codes.reshape(N, K // 32, 32).astype(np.int8), scale, mins


def _q6_k(raw: np.ndarray, N: int, K: int):
    blocks = raw.reshape(-1, 210)  # [B, ql(128) qh(64) scales(16, int8) d(2)]
    scale = _records(blocks[:, 192:208], _f16(blocks[:, 208:]), N, K)  # compact: d * sc, sc int8
    # the codes packed as the file has them (layers/six_bit.h), a view here: [N, K/256, ql + qh]
    return 6, 16, blocks[:, :192].reshape(N, K // 256, 192), scale, None


REPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q4_K": _q4_k, "Q5_K": _q5_k,
             "Q6_K": _q6_k}


def repack(type_name: str, raw: np.ndarray, shape: tuple[int, int], tile: bool = False,
           compact: bool = True) -> QuantizedWeight:
    """Raw block bytes of a [N, K] GGUF tensor (numpy order) -> QuantizedWeight [N, K], in the rows
    layout, or with ``tile`` in the tiled one where the format has it (``quantized.tiled``): one copy of
    the codes and scales from the file's blocks, straight into that layout. K-quant scales are compact
    (layers/kscales.py) unless ``compact`` is False: then float32 (the same values)."""
    N, K = shape
    bits, group, codes, scale, mins = REPACKERS[type_name](raw, N, K)
    if scale.ndim == 3 and not compact:  # the records' float32 values d * code (exact)
        scale, mins = (None if r is None else kscales.expand(torch.from_numpy(r), group).numpy() for r in (scale, mins))
    layout = _tiles if tile and group == 32 and N % TILE == 0 else _rows
    codes = torch.from_numpy(layout(codes))
    if scale.ndim == 3:  # compact records (kscales.py): made here, already owned
        records = torch.from_numpy(np.ascontiguousarray(scale)), None if mins is None else torch.from_numpy(mins)
        scale, mins = (kscales.tile_records(r, N // TILE) if r is not None and layout is _tiles else r for r in records)
    else:
        scale, mins = (None if t is None else torch.from_numpy(layout(t)) for t in (scale, mins))
    weight = QuantizedWeight(type_name, bits, group, codes, scale, mins, outputs=N)
    return tiled(weight) if tile else weight  # (tiled: a no-op where done, pads N to whole tiles otherwise)


def _rows(field: np.ndarray) -> np.ndarray:
    """codes [N, groups, bytes] or scale/mins [N, groups] -> a contiguous array we own ([N, groups * bytes])."""
    N = field.shape[0]
    if field.ndim == 3 and field.shape[-1] % 8 == 0:  # moved 8 bytes at a time: 3x faster than byte by byte
        return _owned(field.view("<u8")).view(field.dtype).reshape(N, -1)
    return _owned(field).reshape(N, -1)


def _tiles(field: np.ndarray) -> np.ndarray:
    """The tiled layout (``quantized.tiled``) of codes [N, groups, bytes] -> [N/TILE, groups, TILE * bytes],
    4 code bytes of each of a tile's outputs in turn; of scale/mins [N, groups] -> [N/TILE, groups, TILE]."""
    N, groups = field.shape[:2]
    if field.ndim == 2:
        return _owned(field.reshape(N // TILE, TILE, groups).transpose(0, 2, 1))  # [tiles, groups, TILE]
    words = field.view("<u4")  # [N, groups, bytes / 4]: unaligned reads are fine
    tiles = words.reshape(N // TILE, TILE, groups, -1).transpose(0, 2, 3, 1)  # [tiles, groups, words, TILE]
    return _owned(tiles).view(field.dtype).reshape(N // TILE, groups, -1)


def _owned(field: np.ndarray) -> np.ndarray:
    """``field`` as a contiguous, writable array: a copy where it is a view of the (read-only) memory
    map, or strided; a computed array as it is."""
    out = np.ascontiguousarray(field)
    return out if out.flags.writeable else out.copy()
