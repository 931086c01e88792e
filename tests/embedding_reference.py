"""Embeddings by their definition, for tests: one prefill-only forward of a left-padded batch with no
cache (the code that served embeddings before they became engine sequences), the final normed hidden
states pooled per sequence (``mean`` over its tokens or its ``last`` token) and L2-normalized. It
shares nothing with the engine (no slot cache, no step plan, no chunks)."""

from __future__ import annotations

import torch

from fastdecode.cache.view import NoCache
from fastdecode.layers.attention import build_attention_mask
from fastdecode.layers.products import Products


def reference_embeddings(model, prompts: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """Token-id lists (each non-empty) -> unit-length embeddings [N, C] float32."""
    B, L = len(prompts), max(len(p) for p in prompts)
    tokens = torch.zeros((B, L), dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    for row, prompt in enumerate(prompts):  # left-padded: every row's last token in the last column
        tokens[row, L - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        valid[row, L - len(prompt):] = True
    positions = (valid.cumsum(dim=1) - 1).clamp(min=0)  # [B, L]: real tokens counted only
    mask = build_attention_mask(valid, 0, L, model.dtype)  # [B, 1, L, L]
    with torch.inference_mode():
        view = NoCache.of_model(model, Products.prompt(torch.get_num_threads(), kernels=model.kernels), mask, positions)
        hidden = model.forward(tokens, positions, view, all_logits=True, hidden=True).float()  # [B, L, C]
    if pooling == "last":
        pooled = hidden[:, -1]  # [B, C]
    else:
        weights = valid.to(hidden.dtype)[..., None]  # [B, L, 1]
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1)  # [B, C]
    return torch.nn.functional.normalize(pooled, dim=-1)
