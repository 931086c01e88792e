"""Load a .gguf file: config and tokenizer from metadata, tensors dequantized to canonical layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, FastDecodeError
from ..models.registry import family_for_gguf
from .checkpoint import Checkpoint, canonical_weights, check_tokenizer_matches
from .gguf_file import GGUFFile
from .names import check_weight_shapes, resolve_weight_names


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> Checkpoint:
    gguf = GGUFFile(path)
    meta = gguf.metadata
    architecture = meta.get("general.architecture")
    if not isinstance(architecture, str):
        raise CheckpointError(f"{path} has no general.architecture metadata")
    family = family_for_gguf(architecture)
    module = family.load_module()
    try:
        config = module.config_from_gguf(meta, set(gguf.tensors))
    except KeyError as exc:
        raise CheckpointError(f"{path} lacks the metadata {exc}") from exc
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise CheckpointError(f"{path} has invalid metadata: {exc}") from exc
    config.validate(str(path))
    required, optional = module.weight_names(config)
    mapping = resolve_weight_names(required, optional, module.GGUF_NAMES, config.num_layers, gguf.tensors,
                                   module.IGNORED_NAME_PATTERNS, str(path))
    check_weight_shapes(module, config, mapping, lambda name: gguf.tensors[name].shape, str(path), gguf=True)

    canonical_of = {name: canonical for canonical, name in mapping.items()}

    def decode(name: str) -> torch.Tensor:
        array = module.gguf_to_hf_layout(canonical_of[name], gguf.dequantized(name), config)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")  # a copy: F32 tensors are read-only views of the mmap
        return torch.from_numpy(array)  # HF layout, float32

    try:
        weights = canonical_weights(mapping, lambda name: decode(name).to(device=device, dtype=dtype),
                                    module.OUT_IN_WEIGHTS, config)
    except FastDecodeError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot decode tensors of {path}: {exc}") from exc

    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(meta, source=str(path))
    check_tokenizer_matches(tokenizer, config, str(path))
    return Checkpoint(config, family, weights, tokenizer, str(path), "gguf")
