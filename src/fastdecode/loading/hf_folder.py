"""Load a Hugging Face folder: config.json, one or sharded *.safetensors, tokenizer files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, FastDecodeError, ModelNotFoundError
from ..models.registry import family_for_hf_config
from .checkpoint import Checkpoint, canonical_weights, check_tokenizer_matches
from .jsonfile import read_json_object
from .names import check_weight_shapes, resolve_weight_names

INDEX_FILE = "model.safetensors.index.json"
# transformers generates with the generation config (generation_config.json, else one derived from
# config.json): for these keys, it is the source of truth.
GENERATION_KEYS = ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id")


def read_json(path: Path, what: str) -> dict[str, Any]:
    return read_json_object(path, what, CheckpointError)


def with_generation_config(hf_config: dict[str, Any], generation: dict[str, Any] | None) -> dict[str, Any]:
    """Encoder-decoder configs: overlay GENERATION_KEYS from the generation config, if there is one
    (absent keys count as None, as in transformers). Decoder-only configs are returned unchanged."""
    if generation is None or not family_for_hf_config(hf_config).is_encoder_decoder:
        return hf_config
    return {**hf_config, **{key: generation.get(key) for key in GENERATION_KEYS}}


def build_config(hf_config: dict[str, Any], source: str):
    """HF config dict -> (family, ModelConfig), with a clear error for a missing field."""
    family = family_for_hf_config(hf_config)
    try:
        config = family.load_module().config_from_hf(hf_config)
    except KeyError as exc:
        raise CheckpointError(f"config of {source} lacks the field {exc.args[0]!r}") from exc
    except (TypeError, ValueError, ArithmeticError) as exc:
        raise CheckpointError(f"config of {source} has an invalid value: {exc}") from exc
    config.validate(source)
    return family, config


def load_hf_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> Checkpoint:
    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    hf_config = read_json(config_path, "model config")
    generation_path = folder / "generation_config.json"
    if generation_path.is_file() and family_for_hf_config(hf_config).is_encoder_decoder:
        hf_config = with_generation_config(hf_config, read_json(generation_path, "generation config"))
    family, config = build_config(hf_config, str(folder))

    files = _safetensors_files(folder)
    tensors = _open_safetensors(files)
    module = family.load_module()
    required, optional = module.weight_names(config)
    mapping = resolve_weight_names(required, optional, module.HF_NAMES, config.layer_counts, tensors,
                                   module.IGNORED_NAME_PATTERNS, str(folder))
    check_weight_shapes(module, config, mapping, lambda name: tensors[name].get_slice(name).get_shape(), str(folder))

    def fetch(name: str) -> torch.Tensor:
        try:
            tensor = tensors[name].get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for bad data
            raise CheckpointError(f"cannot read tensor {name!r} from {folder}: {exc}") from exc
        return tensor.to(device=device, dtype=dtype)

    weights = canonical_weights(mapping, fetch, module.OUT_IN_WEIGHTS, config)

    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer

        tokenizer = Tokenizer.from_hf_folder(folder)
        check_tokenizer_matches(tokenizer, config, str(folder))
    return Checkpoint(config, family, weights, tokenizer, str(folder), "safetensors")


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, "safetensors index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
            raise CheckpointError(f"{folder} has only PyTorch pickle weights; save it with safetensors")
        raise CheckpointError(f"{folder} has no *.safetensors weights")
    return files


def _open_safetensors(files: list[Path]) -> dict[str, Any]:
    """name -> open safe_open handle (memory-mapped), validating each file's header."""
    from safetensors import safe_open

    handles: dict[str, Any] = {}
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            names = list(handle.keys())
        except FastDecodeError:
            raise
        except Exception as exc:  # SafetensorError, OSError: corrupt or truncated
            raise CheckpointError(f"corrupt or truncated safetensors file {path}: {exc}") from exc
        for name in names:
            handles[name] = handle
    return handles
