"""The Llama family: Llama 1-3, Mistral, Qwen2 and SmolLM2 are one decoder with config flags.

Pre-norm blocks (RMSNorm), rotary positions (half-split layout), grouped-query attention,
gated SiLU MLP. Flags: q/k/v bias (Qwen2), tied embeddings, RoPE scaling, sliding window
(Mistral). Weights are held as plain tensors under canonical names and used functionally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cache.static import KVCache, NoCache
from .base import ModelBase, Weight, token_id_list
from ..config import FULL, SLIDING, ModelConfig
from ..layers.linear import ACTIVATIONS, embed, linear
from ..layers.threads import one_thread_except_big_ops
from ..errors import UnsupportedModelError
from ..layers.attention import LayerMasks
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.positions import RotaryEmbedding, rope_inverse_frequencies
from ..layers.elementwise import add_rms_norm, gated, qkv_heads, rms_norm
from .llama_decode import FusedDecode
from ..config import derived_head_dim

# Canonical weight name -> name in each format. "{layer}" is the block index.
HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
    "layers.{layer}.q.weight": "model.layers.{layer}.self_attn.q_proj.weight",
    "layers.{layer}.k.weight": "model.layers.{layer}.self_attn.k_proj.weight",
    "layers.{layer}.v.weight": "model.layers.{layer}.self_attn.v_proj.weight",
    "layers.{layer}.q.bias": "model.layers.{layer}.self_attn.q_proj.bias",
    "layers.{layer}.k.bias": "model.layers.{layer}.self_attn.k_proj.bias",
    "layers.{layer}.v.bias": "model.layers.{layer}.self_attn.v_proj.bias",
    "layers.{layer}.o.weight": "model.layers.{layer}.self_attn.o_proj.weight",
    "layers.{layer}.o.bias": "model.layers.{layer}.self_attn.o_proj.bias",
    "layers.{layer}.mlp_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.gate.weight": "model.layers.{layer}.mlp.gate_proj.weight",
    "layers.{layer}.up.weight": "model.layers.{layer}.mlp.up_proj.weight",
    "layers.{layer}.down.weight": "model.layers.{layer}.mlp.down_proj.weight",
    "layers.{layer}.gate.bias": "model.layers.{layer}.mlp.gate_proj.bias",
    "layers.{layer}.up.bias": "model.layers.{layer}.mlp.up_proj.bias",
    "layers.{layer}.down.bias": "model.layers.{layer}.mlp.down_proj.bias",
}
GGUF_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{layer}.attn_norm.weight": "blk.{layer}.attn_norm.weight",
    "layers.{layer}.q.weight": "blk.{layer}.attn_q.weight",
    "layers.{layer}.k.weight": "blk.{layer}.attn_k.weight",
    "layers.{layer}.v.weight": "blk.{layer}.attn_v.weight",
    "layers.{layer}.q.bias": "blk.{layer}.attn_q.bias",
    "layers.{layer}.k.bias": "blk.{layer}.attn_k.bias",
    "layers.{layer}.v.bias": "blk.{layer}.attn_v.bias",
    "layers.{layer}.o.weight": "blk.{layer}.attn_output.weight",
    "layers.{layer}.mlp_norm.weight": "blk.{layer}.ffn_norm.weight",
    "layers.{layer}.gate.weight": "blk.{layer}.ffn_gate.weight",
    "layers.{layer}.up.weight": "blk.{layer}.ffn_up.weight",
    "layers.{layer}.down.weight": "blk.{layer}.ffn_down.weight",
}
# HF (and GGUF, once in HF layout) store these [out, in]; the canonical layout is [in, out].
OUT_IN_WEIGHTS = ("q.weight", "k.weight", "v.weight", "o.weight", "gate.weight", "up.weight", "down.weight",
                  "lm_head.weight")
# Buffers some checkpoints carry that are not weights.
IGNORED_NAME_PATTERNS = (r".*rotary_emb\.inv_freq$", r"^rope_freqs\.weight$")


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    """(required, optional) canonical names for this config."""
    required = ["embed.weight", "norm.weight"]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    per_layer = ["attn_norm.weight", "q.weight", "k.weight", "v.weight", "o.weight", "mlp_norm.weight",
                 "gate.weight", "up.weight", "down.weight"]
    if config.attention_bias:
        per_layer += ["q.bias", "k.bias", "v.bias"]
    if config.attention_out_bias:
        per_layer += ["o.bias"]
    if config.mlp_bias:
        per_layer += ["gate.bias", "up.bias", "down.bias"]
    required += [f"layers.{{layer}}.{name}" for name in per_layer]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the checkpoint (HF) layout; the loader checks every weight against it."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {"attn_norm.weight": (C,), "q.weight": (q, C), "k.weight": (kv, C), "v.weight": (kv, C),
             "q.bias": (q,), "k.bias": (kv,), "v.bias": (kv,), "o.weight": (C, q), "o.bias": (C,),
             "mlp_norm.weight": (C,), "gate.weight": (I, C), "up.weight": (I, C), "down.weight": (C, I),
             "gate.bias": (I,), "up.bias": (I,), "down.bias": (C,)}
    return {"embed.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a HF config.json dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    model_type = hf.get("model_type", "llama")
    sliding_window = hf.get("sliding_window") if model_type == "mistral" or hf.get("use_sliding_window") else None
    layer_types = list(hf.get("layer_types") or []) if sliding_window is not None else []
    if model_type == "qwen2" and sliding_window is not None and not layer_types:
        # Qwen2: the first max_window_layers layers attend fully, the later ones through the window
        first_sliding = hf.get("max_window_layers", hf["num_hidden_layers"])
        layer_types = [SLIDING if i >= first_sliding else FULL for i in range(hf["num_hidden_layers"])]
    return ModelConfig(
        family="llama",
        architecture=(hf.get("architectures") or [model_type])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or derived_head_dim(hidden, num_heads),
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        attention_out_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        sliding_window=sliding_window,
        layer_types=layer_types,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_id_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def require(key: str) -> Any:
        return meta[f"{arch}.{key}"]  # KeyError: the loader reports the missing key

    hidden = require("embedding_length")
    num_heads = require("attention.head_count")
    head_dim = get("attention.key_length") or derived_head_dim(hidden, num_heads, ("embedding_length", "attention.head_count"))
    rotary_dim = get("rope.dimension_count") or head_dim
    scaling = None
    if get("rope.scaling.type") in ("linear", "yarn"):
        scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor"),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
    return ModelConfig(
        family="llama",
        architecture=arch,
        vocab_size=get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        hidden_size=hidden,
        num_layers=require("block_count"),
        num_heads=num_heads,
        num_kv_heads=get("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        intermediate_size=require("feed_forward_length"),
        max_position_embeddings=get("context_length", 2048),
        norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        partial_rotary_factor=rotary_dim / head_dim,
        sliding_window=get("attention.sliding_window"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=token_id_list(meta.get("tokenizer.ggml.eos_token_id")),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undo the Q/K row permutation llama.cpp's converter applies.

    HF stores Q/K rows for half-split RoPE (pairs i, i + D/2); GGUF llama files store them for
    interleaved RoPE (pairs 2i, 2i + 1). The converter maps, per head, row (half h, index i) to
    row (i, half h): rows [H, 2, D/2] -> [H, D/2, 2]. We invert it, rows [H, D/2, 2] -> [H, 2, D/2],
    so one half-split RoPE serves both formats. Applies to weights and biases alike.
    """
    if config.architecture not in ("llama", "mistral"):  # qwen2 GGUFs keep HF (NeoX) order
        return weight
    if canonical.endswith((".q.weight", ".q.bias")):
        heads = config.num_heads
    elif canonical.endswith((".k.weight", ".k.bias")):
        heads = config.num_kv_heads
    else:
        return weight
    rest = weight.shape[1:]
    rotary = weight.reshape(heads, config.head_dim // 2, 2, *rest)  # [H, D/2, 2, ...]
    return rotary.swapaxes(1, 2).reshape(weight.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


@dataclass(frozen=True, slots=True, eq=False)
class LlamaBlock:
    """One decoder block's weights: norm scales [C]; Q, K, V as one fused product and gate, up as
    another (``FusedProjection``); o and down as [out, in] views of [in, out] buffers; a bias per
    projection where the checkpoint has one (Qwen2: q, k, v)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: FusedProjection
    o: Weight
    gate_up: FusedProjection
    down: Weight
    o_bias: torch.Tensor | None
    down_bias: torch.Tensor | None


class LlamaModel(ModelBase):
    """Decoder-only Llama-family model over canonical weights."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor]):
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported")
        self.config = config
        self.embed = weights["embed.weight"]
        self.norm = weights["norm.weight"]
        self.lm_head = weights["lm_head.weight"].t()  # [C, V] buffer seen as [V, C] for linear()
        self.layers = [
            LlamaBlock(
                attn_norm=weights[f"layers.{i}.attn_norm.weight"],
                mlp_norm=weights[f"layers.{i}.mlp_norm.weight"],
                **self.fused_products(weights, i),
                # [in, out] buffers seen as [out, in]: linear() then runs x @ buffer (the fast layout)
                **{name: weights[f"layers.{i}.{name}.weight"].t() for name in ("o", "down")},
                **{f"{name}_bias": weights.get(f"layers.{i}.{name}.bias") for name in ("o", "down")},
            )
            for i in range(config.num_layers)
        ]
        # the norm after each block: the next block's input norm, the final norm after the last
        self.next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        self.layer_windows = config.layer_windows  # None: full attention; else the layer's window
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq, attention_factor = rope_inverse_frequencies(
            rotary_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.rope = RotaryEmbedding(rotary_dim, inv_freq, attention_factor)
        self.layer_ropes = [self.rope] * config.num_layers  # every layer shares one rotary table
        self.scale = config.head_dim**-0.5
        self.fused_decode = FusedDecode.for_model(self)  # pure decode steps: one op per block, or None

    def fused_products(self, weights: dict[str, torch.Tensor], i: int) -> dict[str, FusedProjection]:
        """Block i's ``qkv`` and ``gate_up`` products from the checkpoint's separate matrices
        (Phi-3, whose checkpoints hold them fused already, overrides this)."""
        return {"qkv": fuse_projections(weights, [f"layers.{i}.{name}" for name in ("q", "k", "v")]),
                "gate_up": fuse_projections(weights, [f"layers.{i}.{name}" for name in ("gate", "up")])}

    @one_thread_except_big_ops
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache | NoCache,
        mask: torch.Tensor | None,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, positions [B, T]; the cache stores this forward's K/V and attends over its slots
        (``NoCache``: within these tokens only). mask: additive [B, 1, T, S] or None.
        Returns logits [B, T, V] if ``all_logits``, [B, K, V] at the token indices ``logits_at`` [K],
        else [B, 1, V] for the last token. ``cache`` may be an engine's ``StepPlan``."""
        cfg = self.config
        B, T = tokens.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = embed(tokens, self.embed)  # [B, T, C]
        rotary = self.rope.tables(positions, x.dtype)  # cos, signed sin [B, T, 1, rot]: once per forward
        masks = LayerMasks(mask, cache, positions, x.dtype)
        # h: the normed input of the next sub-block; each residual add is fused with the norm after it
        h = rms_norm(x, self.layers[0].attn_norm, cfg.norm_eps)
        fused = self.fused_decode.step(cache, x) if self.fused_decode is not None else None
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            if fused is not None and (block := fused(index, x, h, *rotary)) is not None:
                x, h = block  # the same ops from C++ (models/llama_decode.py)
                continue
            q, k, v = qkv_heads(layer.qkv(h), H, Hkv, *rotary)  # [B, H or Hkv, T, D]: q and k rotated
            o = cache.attend(index, q, k, v, masks.for_window(self.layer_windows[index]), self.scale)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]
            x, h = add_rms_norm(x, linear(o, layer.o, layer.o_bias), layer.mlp_norm, cfg.norm_eps)
            mlp = linear(gated(layer.gate_up(h), cfg.hidden_act), layer.down, layer.down_bias)  # [B, T, C]
            # the last block's output goes through the final norm (row-wise, so before output_rows)
            x, h = add_rms_norm(x, mlp, next_norm, cfg.norm_eps)
        return linear(self.output_rows(h, all_logits, logits_at), self.lm_head)  # [B, T or 1, V]
