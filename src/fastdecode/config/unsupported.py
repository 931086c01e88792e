"""Config keys that change a model's math: a family that does not implement one refuses it by name.

A checkpoint whose config sets such a key to a value other than its neutral one would otherwise
load and run with the key silently ignored, giving wrong logits. Each family's ``config_from_hf``
(``config_from_gguf``) calls ``refuse_unimplemented`` with the keys it does implement.
"""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError

# config.json key -> the values that mean "not used" (absent counts as not used)
HF_MATH_KEYS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "query_pre_attn_scalar": (None,),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "attention_multiplier": (None,),
    "logits_scaling": (None, 1, 1.0),
    "no_rope_layers": (None,),
    "clip_qkv": (None,),
    "use_qk_norm": (None, False),
    "qk_layernorm": (None, False),
    "use_bidirectional_attention": (None, False),
    "num_local_experts": (None, 0),
    "num_experts": (None, 0),
    "attention_chunk_size": (None,),
}
# GGUF metadata key (after "{arch}.") -> the values that mean "not used"
GGUF_MATH_KEYS: dict[str, tuple[Any, ...]] = {
    "attn_logit_softcapping": (None, 0, 0.0),
    "final_logit_softcapping": (None, 0, 0.0),
    "embedding_scale": (None, 0, 0.0, 1, 1.0),
    "residual_scale": (None, 0, 0.0, 1, 1.0),
    "logit_scale": (None, 0, 0.0, 1, 1.0),
    "attention.scale": (None, 0, 0.0),
    "attention.clamp_kqv": (None, 0, 0.0),
    "expert_count": (None, 0),
}


def refuse_unimplemented(values: dict[str, Any], implemented: tuple[str, ...], architecture: str,
                         prefix: str = "", keys: dict[str, tuple[Any, ...]] = HF_MATH_KEYS) -> None:
    """UnsupportedModelError naming every key of ``keys`` that ``values`` sets (to a non-neutral value)
    and that the family does not implement. ``prefix``: GGUF's "{arch}." before each key."""
    found = [f"{key}={values[prefix + key]!r}" for key, neutral in keys.items()
             if key not in implemented and values.get(prefix + key) not in neutral]
    if found:
        raise UnsupportedModelError(
            f"{architecture}: config sets {', '.join(found)}, which fastdecode does not implement for this "
            "architecture (refused rather than ignored: it changes the model's output)")


def refuse_unimplemented_gguf(meta: dict[str, Any], implemented: tuple[str, ...]) -> None:
    arch = meta["general.architecture"]
    refuse_unimplemented(meta, implemented, f"GGUF {arch}", prefix=f"{arch}.", keys=GGUF_MATH_KEYS)
