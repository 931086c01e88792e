"""The de-duplicated beam cache attends exactly like a plain cache holding the prompt once per beam."""

from __future__ import annotations

import pytest
import torch

from fastdecode.cache.beam import BeamKVCache
from fastdecode.layers.attention import attention


@pytest.mark.parametrize("heads, kv_heads, with_bias", [(4, 4, False), (4, 2, False), (4, 1, False), (4, 4, True)])
def test_attend_equals_attention_over_repeated_prompt(heads, kv_heads, with_bias):
    torch.manual_seed(0)
    L, B, K, S_p, D, steps = 2, 3, 4, 6, 8, 3
    prompt_k, prompt_v = torch.randn(L, B, kv_heads, S_p, D), torch.randn(L, B, kv_heads, S_p, D)
    valid = torch.ones(B, S_p, dtype=torch.bool)
    valid[1, :2] = False  # a left-padded sample
    positions = (valid.cumsum(1) - 1).clamp(min=0)
    cache = BeamKVCache(prompt_k, prompt_v, valid, positions, K, capacity=steps)
    gen_k, gen_v = torch.zeros(B * K, kv_heads, 0, D), torch.zeros(B * K, kv_heads, 0, D)
    for step in range(steps):
        cache.append_slot(positions[:, -1] + 1 + step)
        q = torch.randn(B * K, heads, 1, D)
        k, v = torch.randn(B * K, kv_heads, 1, D), torch.randn(B * K, kv_heads, 1, D)
        gen_k, gen_v = torch.cat([gen_k, k], 2), torch.cat([gen_v, v], 2)
        S = S_p + step + 1
        bias = torch.randn(B * K, heads, 1, S) if with_bias else None
        ours = cache.attend(0, q, k, v, bias, 0.3)
        full_k = torch.cat([prompt_k[0].repeat_interleave(K, 0), gen_k], 2)  # [B*K, Hkv, S, D]
        full_v = torch.cat([prompt_v[0].repeat_interleave(K, 0), gen_v], 2)
        mask = torch.zeros(B * K, 1, 1, S)
        mask[..., :S_p] = torch.where(valid.repeat_interleave(K, 0), 0.0, float("-inf"))[:, None, None]
        reference = attention(q, full_k, full_v, mask if bias is None else mask + bias, 0.3)
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
        # A reorder moves generated K/V only: beam 0 of every sample now continues from its beam 2.
        rows = (torch.arange(B)[:, None] * K + torch.tensor([2, 2, 1, 3])).flatten()
        cache.keep_rows(rows)
        gen_k, gen_v = gen_k.index_select(0, rows), gen_v.index_select(0, rows)
    assert cache.shared_nbytes == prompt_k.nbytes + prompt_v.nbytes
