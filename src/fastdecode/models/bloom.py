"""BLOOM: ALiBi attention biases instead of position embeddings, a layer norm on the embeddings,
fused QKV (interleaved per head), pre-LayerNorm blocks, GELU (tanh) MLP, tied LM head.

ALiBi adds ``slope_h * (key_position - query_position)`` to every score. Only position
differences matter, which is what lets a streaming cache shift positions without recomputation:
the view adds the bias from its own key-query distances in the current frames (its ``score_bias``
is ``alibi_bias``; cache/view.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..cache.view import CacheView
from .base import LayerNormBlock, ModelBase
from ..config import ModelConfig
from ..layers.linear import embed, linear
from ..layers.products import KernelChoice
from ..layers.threads import on_one_thread
from ..layers.positions import alibi_slopes
from ..config import derived_head_dim

HF_NAMES = {
    "embed.weight": "transformer.word_embeddings.weight",
    "embed_norm.weight": "transformer.word_embeddings_layernorm.weight",
    "embed_norm.bias": "transformer.word_embeddings_layernorm.bias",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "transformer.h.{layer}.input_layernorm.weight",
    "layers.{layer}.attn_norm.bias": "transformer.h.{layer}.input_layernorm.bias",
    "layers.{layer}.qkv.weight": "transformer.h.{layer}.self_attention.query_key_value.weight",
    "layers.{layer}.qkv.bias": "transformer.h.{layer}.self_attention.query_key_value.bias",
    "layers.{layer}.o.weight": "transformer.h.{layer}.self_attention.dense.weight",
    "layers.{layer}.o.bias": "transformer.h.{layer}.self_attention.dense.bias",
    "layers.{layer}.mlp_norm.weight": "transformer.h.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.mlp_norm.bias": "transformer.h.{layer}.post_attention_layernorm.bias",
    "layers.{layer}.up.weight": "transformer.h.{layer}.mlp.dense_h_to_4h.weight",
    "layers.{layer}.up.bias": "transformer.h.{layer}.mlp.dense_h_to_4h.bias",
    "layers.{layer}.down.weight": "transformer.h.{layer}.mlp.dense_4h_to_h.weight",
    "layers.{layer}.down.bias": "transformer.h.{layer}.mlp.dense_4h_to_h.bias",
}
GGUF_NAMES: dict[str, str] = {}  # BLOOM GGUF files are not supported
OUT_IN_WEIGHTS = ("qkv.weight", "o.weight", "up.weight", "down.weight", "lm_head.weight")
IGNORED_NAME_PATTERNS: tuple[str, ...] = ()
_PARTS = ("attn_norm", "qkv", "o", "mlp_norm", "up", "down")


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    required = ["embed.weight", "embed_norm.weight", "embed_norm.bias", "norm.weight", "norm.bias"]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    required += [f"layers.{{layer}}.{part}.{kind}" for part in _PARTS for kind in ("weight", "bias")]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the HF layout ([out, in] linear weights, fused QKV)."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    layer = {"attn_norm.weight": (C,), "attn_norm.bias": (C,), "qkv.weight": (3 * C, C), "qkv.bias": (3 * C,),
             "o.weight": (C, C), "o.bias": (C,), "mlp_norm.weight": (C,), "mlp_norm.bias": (C,),
             "up.weight": (I, C), "up.bias": (I,), "down.weight": (C, I), "down.bias": (C,)}
    return {"embed.weight": (V, C), "embed_norm.weight": (C,), "embed_norm.bias": (C,), "norm.weight": (C,),
            "norm.bias": (C,), "lm_head.weight": (V, C),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden = hf.get("hidden_size") or hf["n_embed"]
    heads = hf["n_head"]
    return ModelConfig(
        family="bloom",
        architecture=(hf.get("architectures") or ["BloomForCausalLM"])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=derived_head_dim(hidden, heads, ("hidden_size", "n_head")),
        intermediate_size=4 * hidden,
        max_position_embeddings=hf.get("seq_length") or hf.get("max_position_embeddings") or 2048,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_act="gelu_pytorch_tanh",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        position_kind="alibi",
        residual_after_norm=bool(hf.get("apply_residual_connection_post_layernorm", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[hf["eos_token_id"]] if hf.get("eos_token_id") is not None else [],
        pad_token_id=hf.get("pad_token_id"),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    raise NotImplementedError  # not registered for GGUF


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    return weight


class BloomModel(ModelBase):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        self.config = config
        self.embed = weights["embed.weight"]
        self.embed_norm = (weights["embed_norm.weight"], weights["embed_norm.bias"])
        self.norm = (weights["norm.weight"], weights["norm.bias"])
        self.lm_head = weights["lm_head.weight"].t()  # [C, V] buffer seen as [V, C] for linear()
        self.layers = []
        for i in range(config.num_layers):
            layer = {part: weights[f"layers.{i}.{part}.weight"] for part in _PARTS}
            layer.update({f"{part}_bias": weights[f"layers.{i}.{part}.bias"] for part in _PARTS})
            for part in ("qkv", "o", "up", "down"):
                layer[part] = layer[part].t()  # [in, out] buffer seen as [out, in]
            self.layers.append(LayerNormBlock(**layer))
        self.slopes = alibi_slopes(config.num_heads).to(self.embed.device)  # [H]
        self.scale = config.head_dim**-0.5

    def alibi_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """slope_h * (key - query position) [B, H, T, S] from distances [B, T, S]. Relative to the
        query (softmax ignores a per-row constant), so values stay small however long a stream runs."""
        return (self.slopes[None, :, None, None] * distance[:, None]).to(self.dtype)  # [B, H, T, S]

    @on_one_thread
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: CacheView, all_logits: bool = False,
                logits_at: torch.Tensor | None = None, hidden: bool = False) -> torch.Tensor:
        """Same contract as ``LlamaModel.forward``: logits [B, T or 1, V]."""
        cfg, p = self.config, cache.products  # the rows' roles and thread budget (layers/products.py)
        B, T = tokens.shape
        H, D, C = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        x = embed(tokens, self.embed)  # [B, T, C]
        x = F.layer_norm(x, (C,), *self.embed_norm, cfg.norm_eps)
        for index, layer in enumerate(self.layers):
            h = F.layer_norm(x, (C,), layer.attn_norm, layer.attn_norm_bias, cfg.norm_eps)
            residual = h if cfg.residual_after_norm else x
            qkv = linear(h, layer.qkv, layer.qkv_bias, products=p).view(B, T, H, 3, D)  # [B, T, H, 3, D]
            q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [B, H, T, D]
            o = cache.attend(index, q, k, v, self.scale)  # [B, H, T, D]: the view adds ALiBi (score_bias)
            o = o.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
            x = residual + linear(o, layer.o, layer.o_bias, products=p)
            h = F.layer_norm(x, (C,), layer.mlp_norm, layer.mlp_norm_bias, cfg.norm_eps)
            residual = h if cfg.residual_after_norm else x
            up = linear(h, layer.up, layer.up_bias, activation="gelu_pytorch_tanh", products=p)  # GELU in the GEMM
            x = residual + linear(up, layer.down, layer.down_bias, products=p)
        x = self.output_rows(x, all_logits, logits_at)
        x = F.layer_norm(x, (C,), *self.norm, cfg.norm_eps)
        if hidden:  # the final-normed hidden states [B, T or K or 1, C] (embeddings)
            return x
        return linear(x, self.lm_head, products=p)  # [B, T or 1, V]
