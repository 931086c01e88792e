"""The ``ModelConfig`` fields every llama.cpp decoder file of the RMSNorm families (Llama's variants,
OLMo 2, Phi-3, Gemma 2 and 3) writes alike, under its ``general.architecture``: the sizes, the tied
head (no ``output.weight``) and the special tokens. Each family adds the keys whose defaults or
meaning it sets itself (head size, norm epsilon, RoPE, context)."""

from __future__ import annotations

from typing import Any

from .base import token_id_list


def gguf_text_fields(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """architecture, vocab_size (the token list's length where the key is absent), hidden_size,
    num_layers, num_heads, intermediate_size, tie_word_embeddings and the bos / eos / pad ids; a
    missing size is a KeyError the loader reports by key."""
    arch = meta["general.architecture"]
    return dict(
        architecture=arch,
        vocab_size=meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        hidden_size=meta[f"{arch}.embedding_length"],
        num_layers=meta[f"{arch}.block_count"],
        num_heads=meta[f"{arch}.attention.head_count"],
        intermediate_size=meta[f"{arch}.feed_forward_length"],
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=token_id_list(meta.get("tokenizer.ggml.eos_token_id")),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
