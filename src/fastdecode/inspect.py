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
    return {
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
        "kv_cache_bytes_per_token": cfg.kv_cache_bytes_per_token(element_size),
        "context_length": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "tied_embeddings": cfg.tie_word_embeddings,
        "has_tokenizer": generator.tokenizer is not None,
        "has_chat_template": bool(generator.tokenizer is not None and generator.tokenizer.chat_template),
    }
