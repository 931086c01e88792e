"""Load a .gguf file: config and tokenizer from metadata, tensors to canonical layout.

Linear weights and the token embedding in a type the kernels run (``gguf_blocks.REPACKERS``) stay
quantized (``QuantizedWeight``, repacked from the file's blocks, never float32); other types are
dequantized to the requested dtype, with one log line naming them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError, FastDecodeError
from ..layers.quantized import QuantizedWeight, keeps_rows_layout
from ..models.registry import family_for_gguf
from .checkpoint import Checkpoint, canonical_weights, check_tokenizer_matches
from .gguf_blocks import REPACKERS, repack
from .gguf_file import GGUFFile
from .names import check_weight_shapes, resolve_weight_names

log = logging.getLogger("fastdecode")


def _hf_layout(module, canonical: str, raw: np.ndarray, config) -> tuple[np.ndarray, bool]:
    """The family's GGUF -> HF layout function applied to a quantized tensor's block rows [N, bytes]:
    (rows, transposed).

    The function is run on a column of row indices [N, 1]: it comes back with rows reordered (the
    llama Q/K RoPE permutation: whole block rows move, codes and scales together) or transposed to
    [1, N] (GPT-2's Conv1D layout: the weight is then seen as [in, out])."""
    index = module.gguf_to_hf_layout(canonical, np.arange(raw.shape[0])[:, None], config)  # [N, 1] or [1, N]
    if index.shape[0] == 1 and raw.shape[0] != 1:
        return raw, True
    order = index[:, 0]
    return (raw if (order == np.arange(len(order))).all() else raw[order]), False


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, native: bool = True) -> Checkpoint:
    """native: keep blocks of a type the kernels run quantized; False decodes every tensor to ``dtype``."""
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
    dequantized_types = set()

    def decode(name: str) -> torch.Tensor | QuantizedWeight:
        canonical, info = canonical_of[name], gguf.tensors[name]
        type_name = info.type_name
        if native and type_name in REPACKERS and len(info.shape) == 2 and "pos_embed" not in canonical:
            raw, transposed = _hf_layout(module, canonical, gguf.raw(name), config)
            weight = repack(type_name, raw, info.shape, tile=not keeps_rows_layout(canonical))  # made once
            return (weight.t() if transposed else weight).to(device)
        if type_name not in ("F32", "F16", "BF16"):
            dequantized_types.add(type_name)
        array = module.gguf_to_hf_layout(canonical_of[name], gguf.dequantized(name), config)
        if not (array.flags.writeable and array.flags.c_contiguous):
            array = np.array(array, order="C")  # a copy: F32 tensors are read-only views of the mmap
        return torch.from_numpy(array)  # HF layout, float32

    kept_float32 = set(getattr(module, "FLOAT32_WEIGHTS", ()))  # values, not matrices: never rounded to dtype

    def fetch(name: str) -> torch.Tensor | QuantizedWeight:
        return decode(name).to(device=device, dtype=torch.float32 if canonical_of[name] in kept_float32 else dtype)

    try:
        weights = canonical_weights(mapping, fetch, module.OUT_IN_WEIGHTS, config)
    except FastDecodeError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(f"cannot decode tensors of {path}: {exc}") from exc

    if dequantized_types:
        log.info("fastdecode: %s has tensors of type %s without a quantized kernel; dequantized at load",
                 path, ", ".join(sorted(dequantized_types)))

    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(meta, source=str(path), path=path)
    check_tokenizer_matches(tokenizer, config, str(path))
    return Checkpoint(config, family, weights, tokenizer, str(path), "gguf")
