"""Load a .gguf file: config and tokenizer from metadata, tensors dequantized to canonical layout."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import CheckpointError, FastDecodeError
from ..models.registry import family_for_gguf
from .checkpoint import Checkpoint, check_tokenizer_matches
from .gguf_file import GGUFFile
from .names import resolve_weight_names


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
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} lacks the metadata {exc}") from exc
    required, optional = module.weight_names(config)
    mapping = resolve_weight_names(required, optional, module.GGUF_NAMES, config.num_layers, gguf.tensors,
                                   module.IGNORED_NAME_PATTERNS, str(path))

    def convert(item: tuple[str, str]) -> tuple[str, torch.Tensor]:
        canonical, name = item
        array = module.gguf_to_hf_layout(canonical, gguf.dequantized(name), config)
        return canonical, torch.from_numpy(array).to(device=device, dtype=dtype).contiguous()

    # numpy's dequantization releases the GIL in its large array operations: two threads
    # roughly halve the load time on two cores.
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(4, torch.get_num_threads()))) as pool:
            weights = dict(pool.map(convert, mapping.items()))
    except FastDecodeError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot decode tensors of {path}: {exc}") from exc

    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(meta)
    check_tokenizer_matches(tokenizer, config, str(path))
    return Checkpoint(config, family, weights, tokenizer, str(path), "gguf")
