"""Logits processors and warpers: pure tensor -> tensor functions, batched, no host sync.

Semantics and order follow Hugging Face ``generate()``: repetition penalty, min-new-tokens EOS
suppression, forced BOS / EOS (encoder-decoder configs), then (sampling only) temperature, top-k, top-p.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [B, V]; seen [B, V] bool (token occurred in prompt or output).

    Seen tokens' logits are divided by ``penalty`` when positive, multiplied when negative.
    """
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def suppress_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Set the given token ids [K] to -inf in every row of logits [B, V] (e.g. EOS before min length)."""
    logits = logits.clone()
    logits[:, token_ids] = float("-inf")
    return logits


def force_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Only the given token ids [K] stay possible (logit 0), every other logit becomes -inf.

    transformers' forced BOS (first target token) and forced EOS (last one before max length).
    """
    forced = torch.full_like(logits, float("-inf"))
    forced[:, token_ids] = 0.0
    return forced


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the ``top_k`` largest logits per row (ties with the k-th are kept, as HF does)."""
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filtering: keep the smallest set of top tokens whose probability reaches ``top_p``."""
    sorted_logits, sorted_index = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely token
    remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))
