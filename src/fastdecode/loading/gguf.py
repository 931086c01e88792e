"""Load a .gguf file: config and tokenizer from metadata, tensors to canonical layout.

Linear weights and the token embedding in a type the kernels run (``gguf_blocks.REPACKERS``) stay
quantized (``QuantizedWeight``, repacked from the file's blocks, never float32); other types are
dequantized to the requested dtype, with one log line naming them.

A native CPU load first looks for the file's weights in the weight cache (weight_cache.py): a hit maps
them, already repacked and fused, instead of repacking; a miss repacks and leaves the checkpoint's
``weight_cache`` set, so that ``fastdecode.load`` saves the built model's weights there.
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
from . import weight_cache

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


def _cached_weights(path: Path, dtype: torch.dtype) -> tuple[dict | None, dict[int, int] | None, tuple | None]:
    """(the weights mapped from the file's cache entry, or None; the file's string arrays' ends, or None;
    (entry path, identity) to save a miss to, or None without a cache)."""
    try:
        identity = weight_cache.gguf_identity(path, dtype)
    except OSError as exc:
        raise CheckpointError(f"cannot read GGUF file {path}: {exc}") from exc
    where = weight_cache.entry_path(identity)
    if where is None:
        return None, None, None
    try:
        return *weight_cache.load(where, identity), None
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, weight_cache.StaleCacheEntry) as exc:
        log.info("fastdecode: rebuilding the cached weights %s of %s (%s)", where, path, exc)
    return None, None, (where, identity)


def load_gguf(path: Path, dtype: torch.dtype, device: torch.device, native: bool = True,
              cached: bool = False) -> Checkpoint:
    """native: keep blocks of a type the kernels run quantized; False decodes every tensor to ``dtype``.
    cached: a native CPU load reads the weight cache (the caller saves a miss: ``Checkpoint.weight_cache``)."""
    weights = string_array_ends = save_to = None
    if cached and native and device.type == "cpu":
        weights, string_array_ends, save_to = _cached_weights(path, dtype)
    gguf = GGUFFile(path, string_array_ends)
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

    if weights is None:
        weights = _decoded_weights(gguf, module, config, mapping, dtype, device, native)
    from .tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(meta, source=str(path), path=path)
    check_tokenizer_matches(tokenizer, config, str(path))
    return Checkpoint(config, family, weights, tokenizer, str(path), "gguf",
                      weight_cache=None if save_to is None else (*save_to, gguf.string_array_ends))


def _decoded_weights(gguf: GGUFFile, module, config, mapping: dict[str, str], dtype: torch.dtype,
                     device: torch.device, native: bool) -> dict:
    """The canonical weights from the file's tensors: repacked where the kernels run their type (native)."""
    path = gguf.path
    canonical_of = {name: canonical for canonical, name in mapping.items()}
    dequantized_types = set()

    def decode(name: str) -> torch.Tensor | QuantizedWeight:
        canonical, info = canonical_of[name], gguf.tensors[name]
        type_name = info.type_name
        if native and type_name in REPACKERS and len(info.shape) == 2 and "pos_embed" not in canonical:
            raw, transposed = _hf_layout(module, canonical, gguf.raw(name), config)
            # made once; tables keep float32 K-quant scales (their rows are looked up), and so does an LM head
            # of another K-quant than Q6_K: its float-activation kernel is compute-bound, where decoding compact
            # scales cost more than their bytes saved. A Q6_K head's kernel decodes the records in registers
            # (rows6_avx512.cpp): Qwen2.5-Coder-1.5B's 151936 x 1536 head reads 191 MB where it read 233, as
            # fast on one busy Zen 5 core (compute-bound: 1.00x) and with less to wait for on two.
            rows_kept = keeps_rows_layout(canonical)
            compact = not rows_kept or (canonical == "lm_head.weight" and type_name == "Q6_K")
            weight = repack(type_name, raw, info.shape, tile=not rows_kept, compact=compact)
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
    return weights
