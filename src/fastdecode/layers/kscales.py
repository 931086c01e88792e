"""Compact K-quant scales: Q4_K, Q5_K and Q6_K's scales and mins kept as GGUF stores them (layers/kscales.h).

Per 256 inputs (a super-block) of one output, 256 / group int8 sub-scale codes c and one float16
super-scale d; a group's scale is d * c, exact in float32 (an 11-bit by at most 8-bit integer product),
so it equals the float32 value a float32 layout would hold and every kernel gives the same bits. Mins
are the same with d = -dmin. The tensors are int8 (which marks them compact), in records:

- rows layout  [N, K/256, S + 2]: the S = 256 / group codes, then the 2 bytes of d (float16);
- tiled layout [tiles, K/256, 80]: byte 8 i + r the code of block i of the super-block for the tile's
  output r (i, r < 8), bytes 64 + 2 r output r's d.

Per 32 weights 2.25 bytes for Q4_K's scale and mins where float32 took 8; per 16 Q6_K weights 1.125
where float32 took 4: about 200 MB less read per token on Qwen2.5-Coder-1.5B Q4_K_M.
"""

from __future__ import annotations

import torch

SUPER = 256  # inputs per record
TILE = 8  # outputs per tile (quantized.TILE)
TILE_RECORD = TILE * TILE + 2 * TILE  # bytes of a tiled record: 8 x 8 codes, 8 float16


def is_compact(scale: torch.Tensor) -> bool:
    return scale.dtype == torch.int8


def rows_records(codes: torch.Tensor, super_scale: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K/256, S] and float16 super-scales [N, K/256] -> rows-layout records [N, K/256, S + 2]."""
    halves = super_scale.contiguous().view(torch.int8).view(*super_scale.shape, 2)  # [N, K/256, 2] bytes
    return torch.cat([codes, halves], dim=-1)


def expand(scale: torch.Tensor, group: int) -> torch.Tensor:
    """Compact records -> the float32 values: rows [N, K/256, S + 2] -> [N, K/group]; tiled
    [tiles, K/256, 80] -> [tiles, K/32, 8] (the float32 tiled layout's)."""
    if scale.shape[-1] == TILE_RECORD:  # (rows records have 10 or 18 bytes)
        tiles, supers = scale.shape[:2]
        codes = scale[..., :TILE * TILE].reshape(tiles, supers, TILE, TILE).float()  # [tiles, supers, block i, output r]
        d = scale[..., TILE * TILE:].contiguous().view(torch.float16).float()  # [tiles, supers, TILE]
        return (d[:, :, None, :] * codes).reshape(tiles, supers * TILE, TILE)  # [tiles, K/32, TILE]
    N, supers, _ = scale.shape
    per = SUPER // group
    d = scale[..., per:].contiguous().view(torch.float16).float()  # [N, supers, 1]
    return (d * scale[..., :per].float()).reshape(N, supers * per)  # [N, K/group]


def tile_records(records: torch.Tensor, tiles: int) -> torch.Tensor:
    """Rows records [N, K/256, 10] (groups of 32) -> tiled records [tiles, K/256, 80], the last tile
    padded with zero records (scale 0)."""
    N, supers, _ = records.shape
    if tiles * TILE != N:
        records = torch.cat([records, records.new_zeros(tiles * TILE - N, supers, records.shape[2])])
    by_tile = records.view(tiles, TILE, supers, TILE + 2)  # [tiles, output r, supers, 8 codes + 2 bytes]
    codes = by_tile[..., :TILE].permute(0, 2, 3, 1)  # [tiles, supers, block i, output r]
    d = by_tile[..., TILE:].permute(0, 2, 1, 3)  # [tiles, supers, output r, 2 bytes]
    return torch.cat([codes.reshape(tiles, supers, TILE * TILE), d.reshape(tiles, supers, 2 * TILE)], dim=-1)


def untile_records(scale: torch.Tensor, tile: torch.Tensor, lane: torch.Tensor) -> torch.Tensor:
    """Tiled records [tiles, K/256, 80] -> the rows records [R, K/256, 10] of outputs 8 tile + lane."""
    tiles, supers, _ = scale.shape
    codes = scale[..., :TILE * TILE].reshape(tiles, supers, TILE, TILE)[tile, :, :, lane]  # [R, supers, block i]
    d = scale[..., TILE * TILE:].reshape(tiles, supers, TILE, 2)[tile, :, lane, :]  # [R, supers, 2 bytes]
    return torch.cat([codes, d], dim=-1)
