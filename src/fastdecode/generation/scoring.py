"""Per-token negative log-likelihood of a token sequence, prefilled through the cache in chunks."""

from __future__ import annotations

import torch

from .step import CachedEngine


def score_tokens(model, ids: list[int], chunk_size: int) -> list[float]:
    """NLL of ids[1:], each given everything before it. Logits exist for one chunk at a time,
    so memory stays bounded by ``chunk_size * vocab`` whatever the length."""
    device = model.device
    tokens = torch.tensor([ids], dtype=torch.long, device=device)  # [1, N]
    engine = CachedEngine(model, 1, len(ids))
    losses: list[torch.Tensor] = []
    with torch.inference_mode():
        for begin in range(0, len(ids) - 1, chunk_size):
            end = min(begin + chunk_size, len(ids) - 1)
            chunk = tokens[:, begin:end]  # [1, T]
            positions = torch.arange(begin, end, device=device)[None]  # [1, T]
            valid = torch.ones_like(chunk, dtype=torch.bool)
            logits = engine.prefill(chunk, valid, positions, all_logits=True)[0]  # [T, V]
            targets = tokens[0, begin + 1 : end + 1]  # [T]
            losses.append(torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none"))
    return torch.cat(losses).tolist()
