"""Packed 6-bit codes (Q6_K as GGUF stores them; the kernels' side: layers/six_bit.h).

A ``QuantizedWeight`` with ``bits=6`` (rows layout, groups of 16) holds per output row and 256 inputs
GGUF's 128 ``ql`` bytes then 64 ``qh`` bytes, codes uint8 [N, K * 3 / 4]; block i < 8 of 32 inputs
(n = i // 4, j = i % 4) is

    code[32 i + l] = ((ql[64 n + 32 (j % 2) + l] >> 4 (j // 2)) & 15 | ((qh[32 n + l] >> 2 j) & 3) << 4) - 32

the int8 codes an 8-bit rows-layout weight of the same values holds (``unpack``), so products on either
give the same bits, from 6 bits read per weight instead of 8.
"""

from __future__ import annotations

import torch

SUPER = 256  # inputs per packed record
SUPER_BYTES = 192  # its bytes: ql (128), qh (64)


def unpack(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes uint8 [R, K * 3 / 4] -> int8 codes [R, K] (-32..31), in input order."""
    R = codes.shape[0]
    supers = codes.reshape(R, -1, SUPER_BYTES).to(torch.int16)  # [R, K/256, 192]
    shifts = torch.arange(0, 8, 4, dtype=torch.int16, device=codes.device)  # ql: low, then high nibbles
    ql = supers[..., :128].reshape(R, -1, 2, 1, 2, 32) >> shifts.view(2, 1, 1)  # [R, S, n, nibble, j % 2, 32]
    qh = supers[..., 128:].reshape(R, -1, 2, 1, 32) >> (2 * torch.arange(4, dtype=torch.int16, device=codes.device)).view(4, 1)
    low = (ql & 15).reshape(R, -1, 2, 4, 32)  # [R, S, n, j, 32]: j = 2 * nibble + j % 2
    high = (qh & 3).reshape(R, -1, 2, 4, 32) << 4  # [R, S, n, j, 32]
    return ((low | high) - 32).to(torch.int8).reshape(R, -1)  # [R, K]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [R, K] (-32..31, K a multiple of 256) -> the packed uint8 [R, K * 3 / 4] (``unpack``'s inverse)."""
    R, K = codes.shape
    if K % SUPER:
        raise ValueError(f"6-bit codes come in records of {SUPER} inputs, not {K}")
    q = (codes.to(torch.int16) + 32).reshape(R, K // SUPER, 2, 4, 32)  # [R, S, n, j, 32], 0..63
    low, high = q & 15, q >> 4
    ql = low[:, :, :, :2] | (low[:, :, :, 2:] << 4)  # [R, S, n, j % 2, 32]: j < 2 low nibbles, j >= 2 high
    qh = high[:, :, :, 0] | (high[:, :, :, 1] << 2) | (high[:, :, :, 2] << 4) | (high[:, :, :, 3] << 6)  # [R, S, n, 32]
    packed = torch.cat([ql.reshape(R, K // SUPER, 128), qh.reshape(R, K // SUPER, 64)], dim=-1)  # [R, S, 192]
    return packed.to(torch.uint8).reshape(R, K * 3 // 4)
