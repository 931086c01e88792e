"""Configs of the Llama-family checkpoints (Llama 1-3, Mistral, Qwen2, Qwen3, Granite, SmolLM3) read
into one ``ModelConfig``: HF config.json dicts and GGUF metadata (llama.cpp's key names).

What each variant adds to the Llama block, as a config field the model acts on:
- Qwen3: RMSNorm on every query and key head before RoPE (``qk_norm="head"``); head_dim set apart
  from hidden / heads; q/k/v/o biases only with ``attention_bias``.
- Granite: ``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier`` (the query
  scale) and ``logits_scaling`` (logits divided by it); llama.cpp names them embedding_scale,
  residual_scale, attention.scale and logit_scale.
- SmolLM3: layers without RoPE (``nope_layers``); HF lists them in ``no_rope_layers`` (1: rotates),
  llama.cpp makes every fourth layer one (``n_no_rope_layer_step = 4``, not in the file).
- Llama 3.x: ``rope_type="llama3"``; its GGUF files carry no scaling keys but a ``rope_freqs``
  tensor of per-frequency divisors instead, which the model applies (models/llama.py).
Any other key that would change the math is refused by name (config/unsupported.py).
"""

from __future__ import annotations

from typing import Any

from ..config import FULL, SLIDING, ModelConfig, derived_head_dim
from ..config.unsupported import refuse_unimplemented, refuse_unimplemented_gguf
from ..errors import UnsupportedModelError
from ..layers.positions import rope_type
from .base import token_id_list
from .gguf_fields import gguf_text_fields

NOPE_INTERVAL = 4  # SmolLM3's default no_rope_layer_interval, and llama.cpp's fixed step
# HF model_type -> the math keys (config/unsupported.py) the family implements
HF_IMPLEMENTED = {"granite": ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"),
                  "smollm3": ("no_rope_layers",)}
GGUF_IMPLEMENTED = {"granite": ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")}


def _nope_from_hf(hf: dict[str, Any], num_layers: int) -> list[int]:
    """SmolLM3's layers without RoPE: ``no_rope_layers`` holds 1 where a layer rotates, 0 where not;
    absent, every ``no_rope_layer_interval``-th layer (as transformers derives it)."""
    uses_rope = hf.get("no_rope_layers")
    if uses_rope is None:
        interval = hf.get("no_rope_layer_interval", NOPE_INTERVAL)
        uses_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(uses_rope, list) or len(uses_rope) != num_layers:
        raise UnsupportedModelError(f"no_rope_layers must list one 0/1 per layer ({num_layers}), got {uses_rope!r}")
    return [i for i, rotates in enumerate(uses_rope) if not rotates]


def _layer_types(hf: dict[str, Any], model_type: str, sliding_window: int | None, nope: list[int]) -> list[str]:
    if sliding_window is None:
        return []
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    num_layers = hf["num_hidden_layers"]
    if model_type in ("qwen2", "qwen3"):
        # the first max_window_layers layers attend fully, the later ones through the window
        first_sliding = hf.get("max_window_layers", num_layers)
        return [SLIDING if i >= first_sliding else FULL for i in range(num_layers)]
    if model_type == "smollm3":  # the window on the layers without RoPE (transformers' derivation)
        return [SLIDING if i in nope else FULL for i in range(num_layers)]
    return []


def hf_decoder_fields(hf: dict[str, Any], default_architecture: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields every Llama-shaped HF config (Llama's variants, OLMo 2, Phi-3) spells
    the same way: sizes, activation, RoPE base and rotated share, tied head, special tokens. The
    context, the norm epsilon and the RoPE scaling, whose defaults or readings differ, are the family's."""
    num_heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    rope = dict(hf.get("rope_parameters") or {})
    return dict(
        architecture=(hf.get("architectures") or [default_architecture])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
        head_dim=hf.get("head_dim") or derived_head_dim(hidden, num_heads),
        intermediate_size=hf["intermediate_size"],
        hidden_act=hf.get("hidden_act", "silu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_id_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def rmsnorm_decoder_fields(hf: dict[str, Any], default_architecture: str) -> dict[str, Any]:
    """``hf_decoder_fields`` with Llama's context and norm epsilon defaults and its RoPE scaling
    (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``), an unknown type refused by name."""
    rope = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    rope_type(scaling)
    return dict(
        hf_decoder_fields(hf, default_architecture),
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_scaling=scaling,
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a HF config.json dict (transformers 4.x ``rope_scaling`` or 5.x ``rope_parameters``)."""
    model_type = hf.get("model_type", "llama")
    fields = rmsnorm_decoder_fields(hf, model_type)
    refuse_unimplemented(hf, HF_IMPLEMENTED.get(model_type, ()), fields["architecture"])
    num_layers = fields["num_layers"]
    sliding_window = hf.get("sliding_window") if model_type == "mistral" or hf.get("use_sliding_window") else None
    nope = _nope_from_hf(hf, num_layers) if model_type == "smollm3" else []
    attention_multiplier = hf.get("attention_multiplier") if model_type == "granite" else None
    return ModelConfig(
        family="llama",
        **fields,
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        attention_out_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_window=sliding_window,
        layer_types=_layer_types(hf, model_type, sliding_window, nope),
        attention_scale=None if attention_multiplier is None else float(attention_multiplier),
        qk_norm="head" if model_type == "qwen3" else None,
        nope_layers=nope,
        embedding_multiplier=float(hf.get("embedding_multiplier") or 1.0) if model_type == "granite" else 1.0,
        residual_multiplier=float(hf.get("residual_multiplier") or 1.0) if model_type == "granite" else 1.0,
        logits_divisor=float(hf.get("logits_scaling") or 1.0) if model_type == "granite" else 1.0,
    )


def _gguf_rope_scaling(get) -> dict[str, Any] | None:
    """GGUF ``rope.scaling.*`` as a HF scaling dict; an unknown type is refused by name. (Llama 3's
    scaling is not here: its files hold the ``rope_freqs`` tensor.)"""
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": get("rope.scaling.factor"),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length")}
        if get("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = get("rope.scaling.attn_factor")
        return scaling
    raise UnsupportedModelError(f"GGUF rope.scaling.type {kind!r} is not supported; supported: none, linear, yarn")


def gguf_decoder_fields(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """``gguf_text_fields`` and what llama.cpp writes alike for the Llama-shaped architectures (Llama's
    variants, OLMo 2, Phi-3): the K/V heads, the head size (hidden / heads unless the file says), the
    norm epsilon, the RoPE base and rotated share. The context, whose default differs, the RoPE
    scaling and the rest are the family's."""
    arch = meta["general.architecture"]
    fields = gguf_text_fields(meta, tensor_names)
    hidden, num_heads = fields["hidden_size"], fields["num_heads"]
    head_dim = meta.get(f"{arch}.attention.key_length") or derived_head_dim(
        hidden, num_heads, ("embedding_length", "attention.head_count"))
    return dict(
        fields,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", num_heads),
        head_dim=head_dim,
        norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        partial_rotary_factor=(meta.get(f"{arch}.rope.dimension_count") or head_dim) / head_dim,
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta["general.architecture"]
    refuse_unimplemented_gguf(meta, GGUF_IMPLEMENTED.get(arch, ()))

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    fields = gguf_decoder_fields(meta, tensor_names)
    num_layers = fields["num_layers"]
    # llama.cpp reads 0 for an absent scale and then leaves that multiplication out
    attention_scale = get("attention.scale") or None
    return ModelConfig(
        family="llama",
        **fields,
        max_position_embeddings=get("context_length", 2048),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        rope_scaling=_gguf_rope_scaling(get),
        sliding_window=get("attention.sliding_window"),
        attention_scale=None if attention_scale is None else float(attention_scale),
        qk_norm="head" if arch == "qwen3" else None,
        nope_layers=[i for i in range(num_layers) if (i + 1) % NOPE_INTERVAL == 0] if arch == "smollm3" else [],
        embedding_multiplier=float(get("embedding_scale") or 1.0),
        residual_multiplier=float(get("residual_scale") or 1.0),
        logits_divisor=float(get("logit_scale") or 1.0),
    )
