"""A model's vital statistics, for `fastdecode inspect` and ``Generator.inspect()``."""

from __future__ import annotations

from typing import Any


def describe(generator: Any) -> dict[str, Any]:
    cfg = generator.config
    checkpoint = generator.checkpoint
    weights = checkpoint.weights
    # Tied weights (the embedding is a view of the LM head) count once: key by storage.
    unique = {t.untyped_storage().data_ptr(): t for t in weights.values()}
    parameters = sum(t.numel() for t in unique.values())
    element_size = next(iter(unique.values())).element_size()
    info = {
        "source": checkpoint.source,
        "format": checkpoint.file_format,
        "architecture": cfg.architecture,
        "family": cfg.family,
        "parameters": parameters,
        "dtype": str(next(iter(unique.values())).dtype).replace("torch.", ""),
        "weight_bytes": sum(t.numel() * t.element_size() for t in unique.values()),
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
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "has_tokenizer": generator.tokenizer is not None,
        "has_chat_template": bool(generator.tokenizer is not None and generator.tokenizer.chat_template),
    }
    if cfg.is_encoder_decoder:
        info = _with_encoder_decoder(info, cfg, generator.model, element_size)
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
        elif key not in ("sliding_window", "attention_layers", "kv_cache_bytes_per_token_by_kind"):
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
