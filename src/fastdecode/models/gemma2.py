"""Gemma 2 (``gemma2``): Gemma 3's model (models/gemma3.py) with the differences set in its config.

The same pre- and post-norm block with (1 + w) RMSNorms, GELU-tanh gated MLP, embeddings times
sqrt(hidden) and queries scaled by ``query_pre_attn_scalar ** -0.5``; what differs is only in the
config: no q/k norms, attention scores soft-capped (``attn_logit_softcapping``, default 50: cap *
tanh(scores / cap) before the mask) as well as the logits (``final_logit_softcapping``, default
30), layers alternating sliding (even) and full (odd) by default, and one RoPE base for both
kinds (10,000). Checkpoints: HF ``Gemma2ForCausalLM`` folders and GGUF ``gemma2`` files (llama.cpp
stores the norms as 1 + w, as for Gemma 3, and keeps the sliding window, both caps and the
2-layer pattern as Gemma 2 defaults: window 4096 unless the file says otherwise).
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..config.unsupported import refuse_unimplemented, refuse_unimplemented_gguf
from ..errors import UnsupportedModelError
from .gemma3 import (GGUF_NAMES, HF_NAMES, IGNORED_NAME_PATTERNS, OUT_IN_WEIGHTS, pattern_layer_types,  # noqa: F401
                     gguf_fields, gguf_to_hf_layout, hf_fields, weight_names, weight_shapes)
from .gemma3 import Gemma3Model as Gemma2Model  # noqa: F401 - the registry's model class

ROPE_THETA = 10_000.0
SLIDING_WINDOW = 4096  # transformers' and llama.cpp's default
ATTENTION_SOFTCAP, FINAL_SOFTCAP = 50.0, 30.0  # transformers' Gemma2Config defaults
PATTERN = 2  # sliding, full, sliding, ...
# the math keys Gemma 2 implements (config/unsupported.py refuses the others by name)
IMPLEMENTED = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a HF ``gemma2`` config (transformers 4.x ``rope_theta`` / ``rope_scaling`` or 5.x
    ``rope_parameters``); an absent cap takes transformers' default, an explicit null turns it off."""
    refuse_unimplemented(hf, IMPLEMENTED, (hf.get("architectures") or ["Gemma2ForCausalLM"])[0])
    if hf.get("attention_bias"):
        raise UnsupportedModelError("Gemma 2 with attention_bias=True is not supported")
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedModelError(f"Gemma 2 with scaled RoPE (rope_type {rope_type!r}) is not supported")
    theta = float(rope.get("rope_theta", hf.get("rope_theta", ROPE_THETA)))
    return ModelConfig(
        family="gemma2",
        architecture=(hf.get("architectures") or ["Gemma2ForCausalLM"])[0],
        rope_theta=theta,
        rope_local_theta=theta,
        layer_types=list(hf.get("layer_types") or pattern_layer_types(hf["num_hidden_layers"], PATTERN)),
        final_logit_softcapping=hf.get("final_logit_softcapping", FINAL_SOFTCAP),
        attention_softcapping=hf.get("attn_logit_softcapping", ATTENTION_SOFTCAP),
        **{**hf_fields(hf, 8192), "sliding_window": hf.get("sliding_window", SLIDING_WINDOW)},
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """GGUF ``gemma2`` (llama.cpp's keys and defaults: the caps and window when absent, pattern 2)."""
    refuse_unimplemented_gguf(meta, ("attn_logit_softcapping", "final_logit_softcapping"))
    theta = float(meta.get("gemma2.rope.freq_base", ROPE_THETA))
    return ModelConfig(
        family="gemma2",
        rope_theta=theta,
        rope_local_theta=theta,
        sliding_window=meta.get("gemma2.attention.sliding_window", SLIDING_WINDOW),
        layer_types=pattern_layer_types(meta["gemma2.block_count"], PATTERN),
        attention_softcapping=meta.get("gemma2.attn_logit_softcapping", ATTENTION_SOFTCAP),
        **{**gguf_fields(meta, tensor_names, 8192),
           "final_logit_softcapping": meta.get("gemma2.final_logit_softcapping", FINAL_SOFTCAP)},
    )
