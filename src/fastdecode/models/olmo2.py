"""OLMo 2: a Llama-shaped decoder whose norms sit after each sub-block, not before it.

Each block is ``x = x + norm(attn(x)); x = x + norm(mlp(x))`` (RMSNorm after the attention and after
the MLP, none on their inputs), and queries and keys are RMS-normed over the whole projection
(H * D and Hkv * D wide, one scale per channel) before RoPE. The rest is Llama's: half-split RoPE
(possibly scaled), grouped-query attention, gated SiLU MLP, a final RMSNorm.

Checkpoints: HF ``Olmo2ForCausalLM`` folders and GGUF ``olmo2`` files (llama.cpp rotates OLMo 2 in
the NeoX, half-split layout, so its converter keeps Q/K rows in HF order: no permutation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cache.view import CacheView
from ..config import ModelConfig
from ..config.unsupported import refuse_unimplemented, refuse_unimplemented_gguf
from ..errors import UnsupportedModelError
from ..layers.attention import merge_heads
from ..layers.elementwise import qkv_heads, rms_norm
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.linear import embed, linear
from ..layers.positions import RotaryEmbedding, rope_inverse_frequencies
from ..layers.products import KernelChoice
from ..layers.threads import on_one_thread
from .base import ModelBase, Weight
from .llama_config import gguf_decoder_fields, rmsnorm_decoder_fields

_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_NORMS = ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm")

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.q_norm.weight": "model.layers.{layer}.self_attn.q_norm.weight",
    "layers.{layer}.k_norm.weight": "model.layers.{layer}.self_attn.k_norm.weight",
    "layers.{layer}.post_attn_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.post_mlp_norm.weight": "model.layers.{layer}.post_feedforward_layernorm.weight",
    **{f"layers.{{layer}}.{name}.{kind}": f"model.layers.{{layer}}.self_attn.{name}_proj.{kind}"
       for name in "qkvo" for kind in ("weight", "bias")},
    **{f"layers.{{layer}}.{name}.weight": f"model.layers.{{layer}}.mlp.{name}_proj.weight"
       for name in ("gate", "up", "down")},
}
_GGUF_PARTS = {"q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output", "gate": "ffn_gate", "up": "ffn_up",
               "down": "ffn_down", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
               "post_attn_norm": "post_attention_norm", "post_mlp_norm": "post_ffw_norm"}
GGUF_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    **{f"layers.{{layer}}.{name}.weight": f"blk.{{layer}}.{part}.weight" for name, part in _GGUF_PARTS.items()},
    **{f"layers.{{layer}}.{name}.bias": f"blk.{{layer}}.{_GGUF_PARTS[name]}.bias" for name in "qkvo"},
}
OUT_IN_WEIGHTS = tuple(f"{name}.weight" for name in _PROJECTIONS) + ("lm_head.weight",)
IGNORED_NAME_PATTERNS = (r".*rotary_emb\.inv_freq$",)


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    required = ["embed.weight", "norm.weight"]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    per_layer = [f"{name}.weight" for name in _NORMS + _PROJECTIONS]
    if config.attention_bias:
        per_layer += [f"{name}.bias" for name in "qkvo"]
    required += [f"layers.{{layer}}.{name}" for name in per_layer]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the checkpoint (HF) layout; the loader checks every weight against it."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {"q.weight": (q, C), "k.weight": (kv, C), "v.weight": (kv, C), "o.weight": (C, q),
             "q.bias": (q,), "k.bias": (kv,), "v.bias": (kv,), "o.bias": (C,),
             "gate.weight": (I, C), "up.weight": (I, C), "down.weight": (C, I),
             "q_norm.weight": (q,), "k_norm.weight": (kv,), "post_attn_norm.weight": (C,), "post_mlp_norm.weight": (C,)}
    return {"embed.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def _refuse_sliding(sliding_window: Any) -> None:
    if sliding_window:
        raise UnsupportedModelError(f"OLMo 2 with a sliding window ({sliding_window}; OLMo 3) is not supported")


def _refuse_partial_rotary(fields: dict[str, Any]) -> None:
    if fields["partial_rotary_factor"] != 1.0:
        raise UnsupportedModelError(f"OLMo 2 with partial_rotary_factor {fields['partial_rotary_factor']} is not supported")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    fields = rmsnorm_decoder_fields(hf, "Olmo2ForCausalLM")
    refuse_unimplemented(hf, (), fields["architecture"])
    _refuse_sliding(hf.get("sliding_window"))
    _refuse_partial_rotary(fields)
    return ModelConfig(family="olmo2", **fields, attention_bias=bool(hf.get("attention_bias", False)),
                       qk_norm="projection")


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    refuse_unimplemented_gguf(meta, ())
    _refuse_sliding(meta.get("olmo2.attention.sliding_window"))
    scaling = meta.get("olmo2.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF olmo2 with rope.scaling.type {scaling!r} is not supported")
    fields = gguf_decoder_fields(meta, tensor_names)
    _refuse_partial_rotary(fields)  # a rope.dimension_count below the head size
    return ModelConfig(
        family="olmo2",
        **fields,
        max_position_embeddings=meta.get("olmo2.context_length", 4096),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="projection",
    )


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    return weight  # Q/K rows in HF order (llama.cpp rotates OLMo 2 half-split), norms as they are


@dataclass(frozen=True, slots=True, eq=False)
class Olmo2Block:
    """One block's weights: q and k norm scales over the whole projection ([H*D], [Hkv*D]), the
    post-attention and post-MLP norm scales [C]; Q, K, V as one fused product and gate, up as
    another; o and down as [out, in] views of [in, out] buffers; o's bias where there is one."""

    q_norm: torch.Tensor
    k_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    post_mlp_norm: torch.Tensor
    qkv: FusedProjection
    o: Weight
    o_bias: torch.Tensor | None
    gate_up: FusedProjection
    down: Weight


class Olmo2Model(ModelBase):
    """Decoder-only OLMo 2 over canonical weights."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        self.take_ends(config, weights)
        self.layers = [
            Olmo2Block(
                **{name: weights[f"layers.{i}.{name}.weight"] for name in _NORMS},
                qkv=fuse_projections(weights, [f"layers.{i}.{name}" for name in ("q", "k", "v")]),
                gate_up=fuse_projections(weights, [f"layers.{i}.{name}" for name in ("gate", "up")]),
                # [in, out] buffers seen as [out, in]: linear() then runs x @ buffer (the fast layout)
                **{name: weights[f"layers.{i}.{name}.weight"].t() for name in ("o", "down")},
                o_bias=weights.get(f"layers.{i}.o.bias"),
            )
            for i in range(config.num_layers)
        ]
        self.layer_windows = config.layer_windows
        inv_freq, factor = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                                    config.max_position_embeddings)
        self.rope = RotaryEmbedding(config.head_dim, inv_freq, factor)
        self.layer_ropes = [self.rope] * config.num_layers
        self.scale = config.head_dim**-0.5

    @on_one_thread
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: CacheView,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """tokens, positions [B, T] -> logits [B, T, V] if ``all_logits``, [B, K, V] at the token
        indices ``logits_at`` [K], else [B, 1, V]; ``cache``: the view it attends through (cache/view.py)."""
        cfg, p = self.config, cache.products  # the rows' roles and thread budget (layers/products.py)
        eps = cfg.norm_eps
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        q_width, k_width = H * cfg.head_dim, Hkv * cfg.head_dim
        x = embed(tokens, self.embed)  # [B, T, C]
        rotary = self.rope.tables(positions, x.dtype)  # cos, signed sin [B, T, 1, D]: once per forward
        for index, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x, p).split([q_width, k_width, k_width], dim=-1)  # [B, T, H*D], [B, T, Hkv*D] x 2
            # q and k RMS-normed over the whole projection, then split into heads and rotated
            qkv = torch.cat((rms_norm(q.contiguous(), layer.q_norm, eps), rms_norm(k.contiguous(), layer.k_norm, eps), v),
                            dim=-1)  # [B, T, (H + 2 Hkv) D]
            q, k, v = qkv_heads(qkv, H, Hkv, *rotary)  # q [B, H, T, D], k, v [B, Hkv, T, D]
            o = cache.attend(index, q, k, v, self.scale)  # [B, H, T, D]
            attended = linear(merge_heads(o), layer.o, layer.o_bias, products=p)  # [B, T, C]
            x = x + rms_norm(attended, layer.post_attn_norm, eps)
            mlp = linear(layer.gate_up.gated(x, cfg.hidden_act, p), layer.down, products=p)  # [B, T, C]
            x = x + rms_norm(mlp, layer.post_mlp_norm, eps)
        h = rms_norm(self.output_rows(x, all_logits, logits_at), self.norm, eps)  # [B, T or K or 1, C]
        return h if hidden else self.head(h, p)  # hidden: the final-normed states (embeddings)
