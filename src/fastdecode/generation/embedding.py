"""Text embeddings from a decoder: one prefill-only forward over a left-padded batch, the final
normed hidden states pooled per sequence (``mean`` over its tokens, or its ``last`` token, the
choice of embedding models trained on causal decoders) and L2-normalized."""

from __future__ import annotations

import torch

from ..cache.view import NoCache
from ..layers.attention import build_attention_mask
from ..layers.products import Products
from .reference import left_pad

POOLINGS = ("mean", "last")


def embed_token_lists(model, prompts: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """Token-id lists (each non-empty) -> unit-length embeddings [N, C] float32."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    tokens, valid, positions = left_pad(prompts, model.device)  # [B, L] each
    mask = build_attention_mask(valid, 0, tokens.shape[1], model.dtype)  # [B, 1, L, L]
    products = Products.prompt(torch.get_num_threads(), kernels=model.kernels)  # prompt rows, the caller's threads
    with torch.inference_mode():
        hidden = model.forward(tokens, positions, NoCache.of_model(model, products, mask, positions), all_logits=True,
                               hidden=True).float()  # [B, L, C]
    if pooling == "last":
        pooled = hidden[:, -1]  # left-padded: the last column holds every row's last token  [B, C]
    else:
        weights = valid.to(hidden.dtype)[..., None]  # [B, L, 1]
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1)  # [B, C]
    return torch.nn.functional.normalize(pooled, dim=-1)
