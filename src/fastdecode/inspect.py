"""A model's vital statistics, for `fastdecode inspect` and ``Generator.inspect()``."""

from __future__ import annotations

import re
from typing import Any


def _storage_key(tensor: Any) -> int:
    """Where a weight's data starts: a tied table and its transposed view share it; fused projections'
    views (layers/fused.py) share one storage but each starts elsewhere in it."""
    codes = getattr(tensor, "codes", tensor)  # a QuantizedWeight is keyed by its codes
    return codes.data_ptr()


def _type_name(tensor: Any) -> str:
    return getattr(tensor, "kind", None) or str(tensor.dtype).replace("torch.", "")


def _nbytes(tensor: Any) -> int:
    return tensor.nbytes if hasattr(tensor, "kind") else tensor.numel() * tensor.element_size()


def weight_groups(weights: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per weight group (layer index folded to ``*``) and type: tensors, bytes, bytes read per token.

    A decode step reads every matrix whole, except an embedding table: only one row per token, unless
    it is also the (tied) LM head. Tied tensors (one storage) count once."""
    head_key = _storage_key(weights["lm_head.weight"]) if "lm_head.weight" in weights else None
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    seen = set()
    for name, tensor in weights.items():
        key = _storage_key(tensor)
        if key in seen:
            continue
        seen.add(key)
        group = re.sub(r"\.\d+\.", ".*.", name)
        row = groups.setdefault((group, _type_name(tensor)), {"group": group, "type": _type_name(tensor),
                                                              "tensors": 0, "bytes": 0, "bytes_read_per_token": 0})
        nbytes = _nbytes(tensor)
        lookup_only = name.endswith("embed.weight") and key != head_key
        row["tensors"] += 1
        row["bytes"] += nbytes
        row["bytes_read_per_token"] += nbytes // tensor.shape[0] if lookup_only else nbytes
    return list(groups.values())


def describe(generator: Any) -> dict[str, Any]:
    cfg = generator.config
    checkpoint = generator.checkpoint
    weights = checkpoint.weights
    # Tied weights (the embedding is a view of the LM head) count once: key by storage.
    unique = {_storage_key(t): t for t in weights.values()}
    parameters = sum(t.numel() for t in unique.values())
    element_size = generator.model.dtype.itemsize
    groups = weight_groups(weights)
    types = sorted({row["type"] for row in groups})
    info = {
        "source": checkpoint.source,
        "format": checkpoint.file_format,
        "architecture": cfg.architecture,
        "family": cfg.family,
        "parameters": parameters,
        "dtype": str(generator.model.dtype).replace("torch.", ""),
        "weight_types": ", ".join(types),
        "weight_bytes": sum(row["bytes"] for row in groups),
        "weight_bytes_read_per_token": sum(row["bytes_read_per_token"] for row in groups),
        "layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "attention": cfg.attention_kind,
        "position_scheme": cfg.position_scheme,
        "sliding_window": cfg.sliding_window,
        "attention_layers": _attention_layers(cfg),
        "kv_cache_bytes_per_token": cfg.kv_cache_bytes_per_token(element_size),
        "kv_cache_bytes_per_token_by_kind": cfg.kv_bytes_per_token_by_kind(element_size),
        "kv_cache_bytes_per_sequence_by_context": _sequence_kv_bytes(cfg, element_size),
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "has_tokenizer": generator.tokenizer is not None,
        "has_chat_template": bool(generator.tokenizer is not None and generator.tokenizer.chat_template),
    }
    if cfg.is_encoder_decoder:
        info = _with_encoder_decoder(info, cfg, generator.model, element_size)
    info["weight_groups"] = groups
    return info


def _with_encoder_decoder(info: dict[str, Any], cfg: Any, model: Any, element_size: int) -> dict[str, Any]:
    """Encoder and decoder depths in place of "layers"; the cross-attention cache next to the KV cache.

    The KV cache grows per target token; the cross-attention cache is per source token, filled once.
    """
    out: dict[str, Any] = {}
    for key, value in info.items():
        if key == "layers":
            out["encoder_layers"] = cfg.num_encoder_layers
            out["decoder_layers"] = cfg.num_layers
        elif key == "kv_cache_bytes_per_token":
            out["kv_cache_bytes_per_target_token"] = value
            out["cross_attention_cache_bytes_per_source_token"] = cfg.cross_cache_bytes_per_source_token(element_size)
        elif key == "context_length":
            out["max_source_positions"] = cfg.max_source_positions or "unbounded (relative)"
        elif key == "tied_embeddings":
            out[key] = getattr(model, "tied_head", value)
        elif key not in ("sliding_window", "attention_layers", "kv_cache_bytes_per_token_by_kind",
                         "kv_cache_bytes_per_sequence_by_context"):
            out[key] = value
        if key == "family":
            out["encoder_decoder"] = True
    out["decoder_start_token_id"] = cfg.decoder_start_token_id
    return out


def _attention_layers(cfg: Any) -> str:
    """How many layers of each attention kind, e.g. "15 sliding (window 512), 3 full"."""
    sliding = cfg.layer_types.count("sliding_attention")
    parts = [f"{sliding} sliding (window {cfg.sliding_window})"] if sliding else []
    full = cfg.num_layers - sliding
    return ", ".join(parts + ([f"{full} full"] if full else []))


def _sequence_kv_bytes(cfg: Any, element_size: int) -> dict[int, int]:
    """K/V bytes one sequence holds in the engine's layered cache at a few context lengths (powers
    of 4 from 512 to the model's context): sliding layers stop growing past their window."""
    from .memory import sequence_kv_bytes

    lengths, length = [], 512
    while length < cfg.max_position_embeddings:
        lengths.append(length)
        length *= 4
    lengths.append(cfg.max_position_embeddings)
    return {n: sequence_kv_bytes(cfg, n, element_size) for n in lengths}
