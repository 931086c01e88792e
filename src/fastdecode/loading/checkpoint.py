"""What every loader returns: a canonical config, canonical tensors and a tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import InvalidOptionError
from ..layers.quantized import QuantizedWeight
from ..models.registry import Family

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Checkpoint:
    config: ModelConfig
    family: Family
    weights: dict[str, torch.Tensor]  # canonical name -> tensor (dtype and device applied)
    tokenizer: Any  # fastdecode.loading.tokenizer.Tokenizer or None
    source: str
    file_format: str  # "safetensors", "gguf" or "transformers (in memory)"
    # (entry path, identity, the GGUF's string arrays' ends): where ``fastdecode.load`` saves the built
    # model's weights (loading/weight_cache.py) after a cache miss; None otherwise
    weight_cache: tuple | None = None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise InvalidOptionError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidOptionError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise InvalidOptionError(f"device {device!r} requested but CUDA is not available on this machine")
    if resolved.type not in ("cpu", "cuda"):
        raise InvalidOptionError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return resolved


def check_tokenizer_matches(tokenizer: Any, config: ModelConfig, source: str) -> None:
    """A tokenizer producing ids past the embedding table would index out of range later."""
    from ..errors import TokenizerError

    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise TokenizerError(
            f"tokenizer of {source} has {tokenizer.vocab_size} tokens but the model's vocabulary has only "
            f"{config.vocab_size}: they do not belong together"
        )



def canonical_weights(
    mapping: dict[str, str],
    fetch: Callable[[str], torch.Tensor],
    out_in_suffixes: tuple[str, ...],
    config: ModelConfig,
    share: bool = False,
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (HF layout) -> canonical tensors, one at a time (no double peak memory).

    Canonical layout: every linear weight is [in, out]. A batch-1 decode step is a chain of
    matrix-vector products, and MKL reads an [in, out] weight faster than [out, in] (figures:
    benchmarks/README.md); models call ``F.linear(x, w.t())``, which runs ``x @ w`` on that buffer.
    Tied embeddings keep one buffer in the LM-head layout [C, V]; the embedding table is its
    transposed view. ``share`` (an in-memory HF model) makes views instead of copies, so no
    weight is duplicated. ``fetch(checkpoint_name)`` returns the tensor in the target dtype/device.
    """

    def io(tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        if isinstance(tensor, QuantizedWeight):  # kept [out, in]; .t() marks the [in, out] view
            return tensor.t()
        return tensor.t() if share else tensor.t().contiguous()

    weights = {}
    for canonical, name in mapping.items():
        tensor = fetch(name)
        weights[canonical] = io(tensor) if canonical.endswith(out_in_suffixes) else tensor
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = io(weights["embed.weight"])  # [C, V]
        weights["embed.weight"] = weights["lm_head.weight"].t()  # [V, C] view of the same memory
    return weights
