"""Helpers the encoder-decoder families (bart.py, t5.py) share: config fields, tied embeddings, the
source-padding mask."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, UnsupportedModelError

def decoder_start_token(hf: dict[str, Any]) -> int:
    """``decoder_start_token_id``, else ``bos_token_id`` (transformers' fallback), else a clear error."""
    for key in ("decoder_start_token_id", "bos_token_id"):
        if hf.get(key) is not None:
            return int(hf[key])
    raise CheckpointError(
        f"the {hf.get('model_type', 'encoder-decoder')} config has neither decoder_start_token_id nor "
        "bos_token_id: an encoder-decoder model needs the token that starts every target sequence"
    )


def check_tied(weights: dict[str, torch.Tensor], names: tuple[str, ...], architecture: str) -> None:
    """Extra embedding names (in memory, transformers' tied aliases) must equal the shared embedding.

    A checkpoint whose encoder or decoder embedding differs from the shared one is a model we
    would silently run wrong, so it is refused rather than ignored.
    """
    embed = weights["embed.weight"]
    for name in names:
        alias = weights.get(name)
        if alias is None or alias is embed:  # absent, or one shared (e.g. quantized) table
            continue
        shared = alias.data_ptr() == embed.data_ptr() and alias.stride() == embed.stride()
        if not (alias.shape == embed.shape and (shared or torch.equal(alias, embed))):
            raise UnsupportedModelError(f"{architecture} with {name} different from the shared embedding "
                                        "(untied encoder/decoder embeddings) is not supported")



def padding_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """valid [B, S] -> additive key mask [B, 1, 1, S] (0 or -inf), or None when nothing is padded.

    Every row keeps at least one real token, so no attention row is all -inf (no NaN).
    """
    if bool(valid.all()):
        return None
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    bias.masked_fill_(~valid, float("-inf"))
    return bias[:, None, None, :]  # [B, 1, 1, S]
