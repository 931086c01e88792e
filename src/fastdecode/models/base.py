"""What every family's model class shares: where its weights live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layers.linear import linear
from ..layers.products import KernelChoice, Products
from ..layers.quantized import QuantizedWeight

# A matrix a block holds: float, or quantized at load (``quantize=``) or in a GGUF file.
Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True, slots=True, eq=False)
class LayerNormBlock:
    """One block's weights in the GPT-2 / BLOOM layout: LayerNorm scales and shifts [C]; a fused
    qkv product, o, up and down as [out, in] views of [in, out] buffers, each with its bias (the
    families differ in how qkv is interleaved, which their forwards handle)."""

    attn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor
    qkv: Weight
    qkv_bias: torch.Tensor
    o: Weight
    o_bias: torch.Tensor
    mlp_norm: torch.Tensor
    mlp_norm_bias: torch.Tensor
    up: Weight
    up_bias: torch.Tensor
    down: Weight
    down_bias: torch.Tensor


def token_id_list(value: Any) -> list[int]:
    """A config's token id field (None, one id or a list of ids) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


class ModelBase:
    """A model holds its weights as plain tensors; ``embed`` is the token embedding table; ``kernels``
    the kernel choice made at load (layers/products.py), which every forward's ``Products`` carry."""

    embed: torch.Tensor
    kernels: KernelChoice

    def take_ends(self, config: Any, weights: dict[str, torch.Tensor]) -> None:
        """Keep the config and the ends of an RMSNorm decoder: the embedding table, the final norm
        scale and the LM head (its [C, V] buffer seen as [V, C] for linear()); the activation checked."""
        from ..errors import UnsupportedModelError
        from ..layers.linear import ACTIVATIONS

        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported")
        self.config = config
        self.embed = weights["embed.weight"]
        self.norm = weights["norm.weight"]
        self.lm_head = weights["lm_head.weight"].t()

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def head(self, hidden: torch.Tensor, products: Products) -> torch.Tensor:
        """Final-normed hidden states [B, K, C] -> logits [B, K, V] (the LM head; a family that scales
        or caps its logits overrides this). ``forward(hidden=True)`` followed by ``head`` on some of
        its rows equals ``forward`` there: an engine step with embedding rows runs it that way."""
        return linear(hidden, self.lm_head, products=products)

    @staticmethod
    def output_rows(x: torch.Tensor, all_logits: bool, logits_at: torch.Tensor | None) -> torch.Tensor:
        """The hidden states [B, T, C] whose logits are wanted: those at ``logits_at`` (token indices
        [K], as an engine step asks: one per sequence it samples), all, or the last -> [B, K|T|1, C]."""
        if logits_at is not None:  # (the one index a single token can have is its own: x as it is)
            return x if x.shape[1] == 1 and logits_at.shape == (1,) else x[:, logits_at]
        return x if all_logits else x[:, -1:]
