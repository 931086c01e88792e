"""Attention of rows that share their first keys (FastSeq): beams of a sample over its prompt.

The K beams of a sample hold the same prompt blocks (by reference in the slot cache). Gathering
those keys once per beam would read the prompt K times per step; instead the K beams are folded
into the query axis against the shared keys, ``[B, Hkv, K*G*T, D] x [B, Hkv, S_shared, D]``, so
each prompt key is read once per sample, and each beam attends to its own keys as usual. One
softmax runs over both segments, so the result is exactly attention over the concatenation.
"""

from __future__ import annotations

import torch

from ..layers.attention import soft_cap


def shared_prefix_attention(q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
                            k_own: torch.Tensor, v_own: torch.Tensor, mask: torch.Tensor, scale: float,
                            softcap: float | None = None) -> torch.Tensor:
    """q [N, H, T, D] for N = B*K rows (K consecutive rows per sample); k_shared, v_shared
    [B, Hkv, S_shared, D] (keys 0..S_shared-1 of every row of the sample); k_own, v_own
    [N, Hkv, S_own, D] (each row's keys after those); mask additive [N, 1|H, T, S_shared + S_own]
    ``softcap``: attention logit soft-capping (``soft_cap``) or None -> [N, H, T, D]."""
    N, H, T, D = q.shape
    B, Hkv, S_shared, _ = k_shared.shape
    K, G = N // B, H // Hkv
    q_row = q.reshape(N, Hkv, G * T, D)  # [N, H, T, D] -> [N, Hkv, G*T, D] (head h = kv*G + g)
    q_sample = q_row.view(B, K, Hkv, G * T, D).transpose(1, 2).reshape(B, Hkv, K * G * T, D)  # beams -> queries
    shared = q_sample @ k_shared.transpose(-1, -2)  # [B, Hkv, K*G*T, S_shared]
    shared = shared.view(B, Hkv, K, G * T, S_shared).transpose(1, 2).reshape(N, Hkv, G * T, S_shared)  # per row
    own = q_row @ k_own.transpose(-1, -2)  # [N, Hkv, G*T, S_own]
    scores = soft_cap(torch.cat((shared, own), dim=-1) * scale, softcap) + _fold_mask(mask, Hkv, G)  # [N, Hkv, G*T, S]
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    p_shared = probs[..., :S_shared].reshape(B, K, Hkv, G * T, S_shared).transpose(1, 2)  # [B, Hkv, K, G*T, S_sh]
    out_shared = p_shared.reshape(B, Hkv, K * G * T, S_shared) @ v_shared  # [B, Hkv, K*G*T, D]
    out_shared = out_shared.view(B, Hkv, K, G * T, D).transpose(1, 2).reshape(N, Hkv, G * T, D)  # per row
    out = out_shared + probs[..., S_shared:] @ v_own  # [N, Hkv, G*T, D]
    return out.reshape(N, H, T, D)  # [N, Hkv, G*T, D] -> [N, H, T, D]


def _fold_mask(mask: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """An additive mask [N, 1|H, T, S] in the folded layout [N, 1|Hkv, G*T, S]."""
    N, h, T, S = mask.shape
    if h == 1:
        return mask.repeat(1, 1, group, 1) if group > 1 else mask  # [N, 1, G*T, S]
    return mask.reshape(N, num_kv_heads, group * T, S)  # [N, H, T, S] -> [N, Hkv, G*T, S]
