"""GGUF ``tokenizer.ggml.pre`` -> how a byte-level BPE vocabulary cuts text into words (data).

A byte-level BPE vocabulary is only reproduced if text is cut into words exactly the way the
merges were learned. GGUF names that split with ``tokenizer.ggml.pre``; each entry below is the
split of the model's original ``tokenizer.json`` (which llama.cpp's ``llm_tokenizer_bpe`` regex
list in llama-vocab.cpp mirrors).
"""

from __future__ import annotations

from typing import Any

from tokenizers import Regex, normalizers, pre_tokenizers

# Llama 3 (tiktoken cl100k style): case-insensitive contractions, numbers in groups of 1-3.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2: like Llama 3 but every digit on its own.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# GPT-2's pattern is built into ``pre_tokenizers.ByteLevel(use_regex=True)``.
def _gpt2_pre() -> tuple[Any, Any, bool]:
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False


def _digits_gpt2_pre() -> tuple[Any, Any, bool]:
    # StarCoder / SmolLM: every digit is its own word, then the GPT-2 split.
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return None, pre, False


def _llama3_pre() -> tuple[Any, Any, bool]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Llama 3's tokenizer.json sets ignore_merges (a word that is itself a token is not re-merged);
    # llama.cpp sets the same flag for this pre-tokenizer.
    return None, pre, True


def _qwen2_pre() -> tuple[Any, Any, bool]:
    pre = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Qwen2's tokenizer.json normalizes to NFC first.
    return normalizers.NFC(), pre, False


# tokenizer.ggml.pre -> factory returning (normalizer, pre_tokenizer, ignore_merges).
# "default" (and a missing key) means GPT-2's split, as in transformers' GGUF converter; llama.cpp's
# own "default" BPE split is a legacy approximation of the same thing.
BYTE_LEVEL_PRE_TOKENIZERS = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "gpt-2": _gpt2_pre,  # the name convert_hf_to_gguf.py writes for GPT-2
    "phi-2": _gpt2_pre,
    "mpt": _gpt2_pre,
    "olmo": _gpt2_pre,
    "smollm": _digits_gpt2_pre,
    "starcoder": _digits_gpt2_pre,
    "refact": _digits_gpt2_pre,
    "command-r": _digits_gpt2_pre,
    "codeshell": _digits_gpt2_pre,
    "llama3": _llama3_pre,
    "llama-v3": _llama3_pre,
    "llama-bpe": _llama3_pre,
    "falcon3": _llama3_pre,
    "pixtral": _llama3_pre,
    "dbrx": _llama3_pre,
    "smaug-bpe": _llama3_pre,
    "qwen2": _qwen2_pre,
    "deepseek-r1-qwen": _qwen2_pre,
}

