"""GPT-2: learned absolute positions, pre-LayerNorm blocks, fused QKV in Conv1D layout, GELU (tanh).

HF's Conv1D stores weights as [in, out], which is also fastdecode's canonical layout: ``F.linear``
gets the transposed view ([out, in]) and runs ``x @ w`` on the buffer, shared with an in-memory
HF model, never copied.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..cache.view import CacheView
from .base import LayerNormBlock, ModelBase
from ..config import ModelConfig
from ..layers.linear import ACTIVATIONS, embed, linear
from ..layers.products import KernelChoice
from ..layers.threads import on_one_thread
from ..errors import UnsupportedModelError
from ..config import derived_head_dim

# Canonical weights keep the Conv1D [in, out] layout for qkv, o, up, down.
HF_NAMES = {
    "embed.weight": "transformer.wte.weight",
    "pos_embed.weight": "transformer.wpe.weight",
    "norm.weight": "transformer.ln_f.weight",
    "norm.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "transformer.h.{layer}.ln_1.weight",
    "layers.{layer}.attn_norm.bias": "transformer.h.{layer}.ln_1.bias",
    "layers.{layer}.qkv.weight": "transformer.h.{layer}.attn.c_attn.weight",
    "layers.{layer}.qkv.bias": "transformer.h.{layer}.attn.c_attn.bias",
    "layers.{layer}.o.weight": "transformer.h.{layer}.attn.c_proj.weight",
    "layers.{layer}.o.bias": "transformer.h.{layer}.attn.c_proj.bias",
    "layers.{layer}.mlp_norm.weight": "transformer.h.{layer}.ln_2.weight",
    "layers.{layer}.mlp_norm.bias": "transformer.h.{layer}.ln_2.bias",
    "layers.{layer}.up.weight": "transformer.h.{layer}.mlp.c_fc.weight",
    "layers.{layer}.up.bias": "transformer.h.{layer}.mlp.c_fc.bias",
    "layers.{layer}.down.weight": "transformer.h.{layer}.mlp.c_proj.weight",
    "layers.{layer}.down.bias": "transformer.h.{layer}.mlp.c_proj.bias",
}
# llama.cpp stores these as [out, in] (ggml order reversed): transposed on load to Conv1D.
GGUF_NAMES = {
    "embed.weight": "token_embd.weight",
    "pos_embed.weight": "position_embd.weight",
    "norm.weight": "output_norm.weight",
    "norm.bias": "output_norm.bias",
    "lm_head.weight": "output.weight",
    "layers.{layer}.attn_norm.weight": "blk.{layer}.attn_norm.weight",
    "layers.{layer}.attn_norm.bias": "blk.{layer}.attn_norm.bias",
    "layers.{layer}.qkv.weight": "blk.{layer}.attn_qkv.weight",
    "layers.{layer}.qkv.bias": "blk.{layer}.attn_qkv.bias",
    "layers.{layer}.o.weight": "blk.{layer}.attn_output.weight",
    "layers.{layer}.o.bias": "blk.{layer}.attn_output.bias",
    "layers.{layer}.mlp_norm.weight": "blk.{layer}.ffn_norm.weight",
    "layers.{layer}.mlp_norm.bias": "blk.{layer}.ffn_norm.bias",
    "layers.{layer}.up.weight": "blk.{layer}.ffn_up.weight",
    "layers.{layer}.up.bias": "blk.{layer}.ffn_up.bias",
    "layers.{layer}.down.weight": "blk.{layer}.ffn_down.weight",
    "layers.{layer}.down.bias": "blk.{layer}.ffn_down.bias",
}
# Conv1D weights are already [in, out] (the canonical layout); only an untied LM head is not.
OUT_IN_WEIGHTS = ("lm_head.weight",)
# Old GPT-2 checkpoints carry the causal-mask buffers as tensors.
IGNORED_NAME_PATTERNS = (r".*attn\.bias$", r".*attn\.masked_bias$")
_CONV1D = ("qkv.weight", "o.weight", "up.weight", "down.weight")


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    required = ["embed.weight", "pos_embed.weight", "norm.weight", "norm.bias"]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    per_layer = [f"{part}.{kind}" for part in ("attn_norm", "qkv", "o", "mlp_norm", "up", "down")
                 for kind in ("weight", "bias")]
    required += [f"layers.{{layer}}.{name}" for name in per_layer]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the HF layout (Conv1D weights are [in, out])."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    layer = {"attn_norm.weight": (C,), "attn_norm.bias": (C,), "qkv.weight": (C, 3 * C), "qkv.bias": (3 * C,),
             "o.weight": (C, C), "o.bias": (C,), "mlp_norm.weight": (C,), "mlp_norm.bias": (C,),
             "up.weight": (C, I), "up.bias": (I,), "down.weight": (I, C), "down.bias": (C,)}
    return {"embed.weight": (V, C), "pos_embed.weight": (config.max_position_embeddings, C), "norm.weight": (C,),
            "norm.bias": (C,), "lm_head.weight": (V, C),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def gguf_shape_to_hf(canonical: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF-layout shape of a GGUF tensor (what ``gguf_to_hf_layout`` will make of it)."""
    return shape[::-1] if canonical.endswith(_CONV1D) else shape


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hidden, heads = hf["n_embd"], hf["n_head"]
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise UnsupportedModelError("gpt2 with scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn is not supported")
    return ModelConfig(
        family="gpt2",
        architecture=(hf.get("architectures") or ["GPT2LMHeadModel"])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=derived_head_dim(hidden, heads, ("n_embd", "n_head")),
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        max_position_embeddings=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        hidden_act=hf.get("activation_function", "gelu_new"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        position_kind="learned",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[hf["eos_token_id"]] if hf.get("eos_token_id") is not None else [],
        pad_token_id=hf.get("pad_token_id"),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    hidden, heads = meta["gpt2.embedding_length"], meta["gpt2.attention.head_count"]
    return ModelConfig(
        family="gpt2",
        architecture="gpt2",
        vocab_size=len(meta.get("tokenizer.ggml.tokens", [])),
        hidden_size=hidden,
        num_layers=meta["gpt2.block_count"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=derived_head_dim(hidden, heads, ("embedding_length", "attention.head_count")),
        intermediate_size=meta.get("gpt2.feed_forward_length", 4 * hidden),
        max_position_embeddings=meta["gpt2.context_length"],
        norm_eps=meta.get("gpt2.attention.layer_norm_epsilon", 1e-5),
        hidden_act="gelu_new",
        tie_word_embeddings="output.weight" not in tensor_names,
        position_kind="learned",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[meta["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in meta else [],
    )


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """GGUF keeps linear weights as [out, in]; the canonical GPT-2 layout is Conv1D [in, out]."""
    return weight.T if canonical.endswith(_CONV1D) else weight


class GPT2Model(ModelBase):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"gpt2 activation {config.hidden_act!r} is not supported")
        self.config = config
        self.embed = weights["embed.weight"]
        self.pos_embed = weights["pos_embed.weight"]
        self.norm = (weights["norm.weight"], weights["norm.bias"])
        self.lm_head = weights["lm_head.weight"].t()  # [C, V] buffer seen as [V, C] for linear()
        names = ("attn_norm", "qkv", "o", "mlp_norm", "up", "down")
        self.layers = []
        for i in range(config.num_layers):
            w = {n: weights[f"layers.{i}.{n}.weight"] for n in names}
            b = {f"{n}_bias": weights[f"layers.{i}.{n}.bias"] for n in names}
            for n in ("qkv", "o", "up", "down"):
                w[n] = w[n].t()  # Conv1D [in, out] -> linear [out, in] (a view)
            self.layers.append(LayerNormBlock(**w, **b))
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
        """Same contract as ``LlamaModel.forward``: logits [B, T or 1, V]."""
        cfg, p = self.config, cache.products  # the rows' roles and thread budget (layers/products.py)
        B, T = tokens.shape
        H, D, C = cfg.num_heads, cfg.head_dim, cfg.hidden_size
        x = embed(tokens, self.embed) + F.embedding(positions, self.pos_embed)  # [B, T, C]
        for index, layer in enumerate(self.layers):
            h = F.layer_norm(x, (C,), layer.attn_norm, layer.attn_norm_bias, cfg.norm_eps)
            qkv = linear(h, layer.qkv, layer.qkv_bias, products=p).view(B, T, 3, H, D)  # [B, T, 3, H, D]
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D]
            o = cache.attend(index, q, k, v, self.scale)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(B, T, C)  # [B, T, C]
            x = x + linear(o, layer.o, layer.o_bias, products=p)
            h = F.layer_norm(x, (C,), layer.mlp_norm, layer.mlp_norm_bias, cfg.norm_eps)
            up = linear(h, layer.up, layer.up_bias, activation=cfg.hidden_act, products=p)  # GELU fused into the GEMM
            x = x + linear(up, layer.down, layer.down_bias, products=p)
        x = self.output_rows(x, all_logits, logits_at)
        x = F.layer_norm(x, (C,), self.norm[0], self.norm[1], cfg.norm_eps)
        if hidden:  # the final-normed hidden states [B, T or K or 1, C] (embeddings)
            return x
        return linear(x, self.lm_head, products=p)  # [B, T or 1, V]
