"""The one attention entry point every family uses, and the mask builder.

Grouped-query and multi-query attention never repeat K/V: the query heads of a group are
folded into the query-time axis, so each KV head is read once for all queries that use it
(DESIGN.md section 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scaled dot-product attention with K/V heads shared by groups of query heads.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D] with H a multiple of Hkv;
    mask: additive [B, 1, T, S] (0 or -inf) or None (every key visible). Without grouping
    (H == Hkv) it may be any bias broadcastable to [B, H, T, S], e.g. T5's per-head relative bias.
    Returns [B, H, T, D].
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    if group > 1:
        # query head h = kv_head * group + g (as HF's repeat_kv); fold g into the time axis.
        q = q.reshape(B, Hkv, group * T, D)  # [B, Hkv, G*T, D]
        if mask is not None:
            S = mask.shape[-1]
            mask = mask[:, :, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)  # [B, 1, G*T, S]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(B, H, T, D)  # [B, Hkv, G*T, D] -> [B, H, T, D]


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Projected [B, T, H*D] -> per-head [B, H, T, D] (a view)."""
    B, T, _ = x.shape
    return x.view(B, T, num_heads, head_dim).transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Attention output [B, H, T, D] -> [B, T, H*D] for the output projection."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]


def build_attention_mask(
    key_valid: torch.Tensor,
    key_positions: torch.Tensor,
    query_start: int,
    num_queries: int,
    sliding_window: int | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive mask [B, 1, T, S] for queries in slots query_start .. query_start+T-1.

    key_valid [B, S]: False for padding slots. key_positions [B, S]: each slot's token position.
    A query sees keys in earlier or equal slots that are valid and, with a sliding window,
    fewer than ``sliding_window`` positions back. Each query always sees its own slot, so a
    padding query never has an empty row (no NaN); its output is never used.
    """
    S = key_valid.shape[1]
    device = key_valid.device
    key_slots = torch.arange(S, device=device)
    query_slots = torch.arange(query_start, query_start + num_queries, device=device)
    causal = key_slots[None, :] <= query_slots[:, None]  # [T, S]
    allowed = causal[None] & key_valid[:, None, :]  # [B, T, S]
    if sliding_window is not None:
        query_positions = key_positions[:, query_start : query_start + num_queries]  # [B, T]
        distance = query_positions[:, :, None] - key_positions[:, None, :]  # [B, T, S]
        allowed &= distance < sliding_window
    allowed |= (key_slots[None, :] == query_slots[:, None])[None]  # own slot
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[:, None]  # [B, 1, T, S]
