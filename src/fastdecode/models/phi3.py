"""Phi-3, Phi-3.5 and Phi-4-mini (``phi3``): the Llama decoder with its products stored fused.

The checkpoint holds Q, K and V as one ``qkv_proj`` matrix (rows: H*D queries, then Hkv*D keys,
then Hkv*D values) and gate with up as one ``gate_up_proj`` (rows: I gate, then I up): exactly the
fused products ``LlamaModel`` builds from separate matrices, so this model takes them as they are.
Everything else is Llama's: RMSNorm pre-norm blocks, half-split RoPE over the first
``partial_rotary_factor`` of each head (Phi-4-mini: 0.75), a sliding window on every layer where
the config sets one (Phi-3-mini-4k: 2047), tied or untied head.

RoPE scaling is LongRoPE (``longrope``, formerly ``su``): per-frequency short and long factors and
an attention factor on cos and sin. transformers uses the short factors while a sequence holds at
most ``original_max_position_embeddings`` tokens and the long ones past that, and recomputes the
whole cache from scratch at the first step past it (``Phi3ForCausalLM.prepare_inputs_for_generation``):
every K/V of every layer changes, so no cached continuation (nor a streaming shift) can be exact
across the switch. fastdecode runs such a model with the short factors over a context capped at
``original_max_position_embeddings``, where its logits are transformers'; a longer request is
refused (PromptTooLongError naming the context). Models without scaling, or whose two factor
lists are equal, keep their whole ``max_position_embeddings``.

GGUF (llama.cpp ``phi3``): ``attn_qkv`` and ``ffn_up`` (gate and up) stay fused, rows in HF order
(llama.cpp rotates Phi-3 in the half-split layout, so nothing is permuted); the factors are the
tensors ``rope_factors_short`` / ``rope_factors_long`` and the attention factor the metadata
``phi3.rope.scaling.attn_factor``; ``phi3.attention.sliding_window`` 0 means none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from ..config.unsupported import refuse_unimplemented, refuse_unimplemented_gguf
from ..errors import UnsupportedModelError
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.positions import longrope_switches
from ..layers.products import KernelChoice
from .llama import LlamaModel
from .llama_config import gguf_decoder_fields, hf_decoder_fields

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
    "layers.{layer}.qkv.weight": "model.layers.{layer}.self_attn.qkv_proj.weight",
    "layers.{layer}.o.weight": "model.layers.{layer}.self_attn.o_proj.weight",
    "layers.{layer}.mlp_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.gate_up.weight": "model.layers.{layer}.mlp.gate_up_proj.weight",
    "layers.{layer}.down.weight": "model.layers.{layer}.mlp.down_proj.weight",
}
GGUF_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "rope.short_factor": "rope_factors_short.weight",
    "rope.long_factor": "rope_factors_long.weight",
    "layers.{layer}.attn_norm.weight": "blk.{layer}.attn_norm.weight",
    "layers.{layer}.qkv.weight": "blk.{layer}.attn_qkv.weight",
    "layers.{layer}.o.weight": "blk.{layer}.attn_output.weight",
    "layers.{layer}.mlp_norm.weight": "blk.{layer}.ffn_norm.weight",
    "layers.{layer}.gate_up.weight": "blk.{layer}.ffn_up.weight",
    "layers.{layer}.down.weight": "blk.{layer}.ffn_down.weight",
}
OUT_IN_WEIGHTS = ("qkv.weight", "o.weight", "gate_up.weight", "down.weight", "lm_head.weight")
FLOAT32_WEIGHTS = ("rope.short_factor", "rope.long_factor")  # loaded as float32 whatever the model's dtype
IGNORED_NAME_PATTERNS = (r".*rotary_emb\..*inv_freq$",)
_PER_LAYER = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "down")
DEFAULT_ORIGINAL_CONTEXT = 4096  # transformers' Phi3Config default for original_max_position_embeddings


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    required = ["embed.weight", "norm.weight"] + [f"layers.{{layer}}.{name}.weight" for name in _PER_LAYER]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    if (config.rope_scaling or {}).get("factors_in_file"):
        required += ["rope.short_factor", "rope.long_factor"]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the checkpoint (HF) layout; the loader checks every weight against it."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    half_rotary = int(config.head_dim * config.partial_rotary_factor) // 2
    layer = {"attn_norm.weight": (C,), "qkv.weight": (q + 2 * kv, C), "o.weight": (C, q), "mlp_norm.weight": (C,),
             "gate_up.weight": (2 * I, C), "down.weight": (C, I)}
    return {"embed.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C),
            "rope.short_factor": (half_rotary,), "rope.long_factor": (half_rotary,),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def _longrope(scaling: dict[str, Any], original: int, max_positions: int) -> dict[str, Any]:
    """A HF ``rope_scaling`` / ``rope_parameters`` entry as the canonical LongRoPE dict; the growth
    factor defaults to max_position_embeddings / original, as transformers computes it."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(scaling.get(key), list):
            raise UnsupportedModelError(f"Phi-3 LongRoPE needs a list {key}, got {scaling.get(key)!r}")
    return {"rope_type": "longrope", "short_factor": list(scaling["short_factor"]),
            "long_factor": list(scaling["long_factor"]), "original_max_position_embeddings": int(original),
            "factor": float(scaling.get("factor") or max_positions / original),
            "attention_factor": scaling.get("attention_factor")}


def _context(max_positions: int, scaling: dict[str, Any] | None) -> int:
    """The context fastdecode runs: capped at the factor switch where LongRoPE's factors differ."""
    if scaling is not None and longrope_switches(scaling):
        return min(max_positions, scaling["original_max_position_embeddings"])
    return max_positions


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a HF ``phi3`` config (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    refuse_unimplemented(hf, (), (hf.get("architectures") or ["Phi3ForCausalLM"])[0])
    rope = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or rope)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    max_positions = hf.get("max_position_embeddings", 4096)
    if rope_type in ("longrope", "su", "yarn"):  # transformers' Phi3Config reads "su" and "yarn" as longrope
        original = (hf.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
                    or DEFAULT_ORIGINAL_CONTEXT)
        scaling = _longrope(scaling, original, max_positions)
    elif rope_type == "default":
        scaling = None
    else:
        raise UnsupportedModelError(f"Phi-3 rope scaling type {rope_type!r} is not supported; supported: longrope (su)")
    return ModelConfig(
        family="phi3",
        **hf_decoder_fields(hf, "Phi3ForCausalLM"),
        max_position_embeddings=_context(max_positions, scaling),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_scaling=scaling,
        sliding_window=hf.get("sliding_window"),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """GGUF ``phi3`` (llama.cpp's keys). The LongRoPE factors are tensors, read with the weights:
    a file that has them is capped at its original context (128k Phi-3 files always carry two
    distinct lists; the cap keeps the short ones exact)."""

    refuse_unimplemented_gguf(meta, ())
    fields = gguf_decoder_fields(meta, tensor_names)
    max_positions = meta.get("phi3.context_length", 4096)
    scaling = None
    if "rope_factors_long.weight" in tensor_names or "rope_factors_short.weight" in tensor_names:
        original = meta["phi3.rope.scaling.original_context_length"]  # KeyError: the loader reports it
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                   "factor": max_positions / original, "attention_factor": meta.get("phi3.rope.scaling.attn_factor"),
                   "factors_in_file": True}
        max_positions = min(max_positions, int(original))
    return ModelConfig(
        family="phi3",
        **fields,
        max_position_embeddings=max_positions,
        rope_scaling=scaling,
        sliding_window=meta.get("phi3.attention.sliding_window") or None,  # 0: none (Phi-4)
    )


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Nothing to undo: llama.cpp keeps Phi-3's fused rows in HF order (half-split RoPE)."""
    return weight


class Phi3Model(LlamaModel):
    """``LlamaModel`` over Phi-3's fused matrices (and, from GGUF, its LongRoPE factor tensors)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        scaling = config.rope_scaling
        if scaling is not None and scaling.get("factors_in_file"):  # GGUF: the factors came as tensors
            factors = {f"{kind}_factor": weights.pop(f"rope.{kind}_factor").double().tolist()
                       for kind in ("short", "long")}
            scaling = {key: value for key, value in scaling.items() if key != "factors_in_file"} | factors
            config = dataclasses.replace(config, rope_scaling=scaling)
        super().__init__(config, weights, kernels)

    def fused_products(self, weights: dict[str, torch.Tensor], i: int) -> dict[str, FusedProjection]:
        """The checkpoint's own fused products, each one matrix, split by output width."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = fuse_projections(weights, [f"layers.{i}.qkv"])
        gate_up = fuse_projections(weights, [f"layers.{i}.gate_up"])
        return {"qkv": dataclasses.replace(qkv, sizes=(q, kv, kv)),
                "gate_up": dataclasses.replace(gate_up, sizes=(cfg.intermediate_size,) * 2)}
