"""A Whisper folder -> the model, its vocabulary and its decoding defaults.

Two layouts: CTranslate2 (``model.bin`` + ``config.json`` with ``suppress_ids`` etc. +
``tokenizer.json``; float16 weights are converted to float32 as they are read) and Hugging Face
``WhisperForConditionalGeneration`` (``config.json`` + ``*.safetensors``; suppress lists from
``generation_config.json``). Both map onto models/whisper.py's canonical weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, InvalidOptionError, ModelNotFoundError
from ..layers.products import KernelChoice
from ..loading.jsonfile import read_json_object
from ..models.whisper import (WhisperConfig, WhisperModel, canonical, config_from_ctranslate2, config_from_hf,
                              ctranslate2_weights, hf_names)
from .alignment import default_alignment_heads
from .vocabulary import WhisperVocabulary


@dataclass
class WhisperCheckpoint:
    config: WhisperConfig
    model: WhisperModel
    vocabulary: WhisperVocabulary | None  # None: a folder without tokenizer.json (model-only use)
    suppress_tokens: list[int] = field(default_factory=list)  # suppressed at every step
    suppress_at_begin: list[int] = field(default_factory=list)  # also at the first sampled step
    source: str = ""
    file_format: str = ""
    alignment_heads: list[tuple[int, int]] = field(default_factory=list)  # (decoder layer, head): word timings


def load_whisper(path: str | Path, need_vocabulary: bool = True, quantize: str | None = None) -> WhisperCheckpoint:
    """``quantize``: None (float32), or "int8" / "int4": the projections and the tied embedding
    quantized at load, every product on int8 activations (as the encoder-decoder families, and as
    CTranslate2's int8), and each window's cross K/V stored in float16 (half the bytes a decode step
    reads; the attention computed in float32); convolutions, norms, biases and position tables stay
    float."""
    if quantize not in (None, "int8", "int4"):
        raise InvalidOptionError(f"quantize must be None, 'int8' or 'int4' for Whisper, got {quantize!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise ModelNotFoundError(f"Whisper model folder {folder} does not exist")
    if (folder / "model.bin").is_file():
        config, weights, extra = _read_ctranslate2(folder)
        file_format = "ctranslate2"
    elif any(folder.glob("*.safetensors")):
        config, weights, extra = _read_hf(folder)
        file_format = "safetensors"
    else:
        raise CheckpointError(f"{folder} has neither model.bin (CTranslate2) nor *.safetensors (Hugging Face)")
    weights = canonical(config, weights, str(folder))
    if quantize is not None:
        from ..loading.quantize import int8_everywhere, quantize_weights

        weights = int8_everywhere(quantize_weights(weights, quantize))
    model = WhisperModel(config, weights, KernelChoice.at_load(None, None),  # the default kernels (int8 rows: int8_everywhere)
                         cross_dtype=None if quantize is None else torch.float16)
    vocabulary = None
    if need_vocabulary or (folder / "tokenizer.json").is_file():
        vocabulary = WhisperVocabulary.from_folder(folder, config.vocab_size)
    heads = [(int(layer), int(head)) for layer, head in extra.get("alignment_heads") or []]
    return WhisperCheckpoint(config, model, vocabulary, _ids(extra, "suppress_ids", "suppress_tokens"),
                             _ids(extra, "suppress_ids_begin", "begin_suppress_tokens"), str(folder), file_format,
                             heads or default_alignment_heads(config.num_layers, config.num_heads))


def _ids(extra: dict[str, Any], *keys: str) -> list[int]:
    for key in keys:
        if isinstance(extra.get(key), list):
            return [int(i) for i in extra[key]]
    return []


def _read_ctranslate2(folder: Path):
    from ..loading.ctranslate2_file import CTranslate2File

    file = CTranslate2File(folder / "model.bin")
    if file.spec != "WhisperSpec":
        raise CheckpointError(f"{folder}/model.bin holds a CTranslate2 {file.spec}, not a Whisper model")
    extra = read_json_object(folder / "config.json", "CTranslate2 config", CheckpointError) if (folder / "config.json").is_file() else {}

    def layers(stack: str) -> int:
        return len({m.group(1) for n in file.names() if (m := re.match(rf"{stack}/layer_(\d+)/", n))})

    def scalar(name: str) -> int:
        return int(file.tensor(name).item())

    try:
        vocabulary_size = file.shape("decoder/embeddings/weight")[0]
        eot = 50256 if vocabulary_size < 51865 else 50257  # checked against tokenizer.json by the vocabulary
        config = config_from_ctranslate2(file.shape, scalar, (layers("encoder"), layers("decoder")), eot, eot + 1)
        weights = ctranslate2_weights(config, lambda name: file.tensor(name).to(torch.float32))
    except KeyError as exc:
        raise CheckpointError(f"{folder}/model.bin lacks the Whisper variable {exc.args[0]!r}") from exc
    return config, weights, extra


def _read_hf(folder: Path):
    from safetensors.torch import load_file

    hf = read_json_object(folder / "config.json", "model config", CheckpointError)
    config = config_from_hf(hf)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        try:
            tensors.update(load_file(str(file)))
        except Exception as exc:  # safetensors' own error types for corrupt data
            raise CheckpointError(f"corrupt or truncated safetensors file {file}: {exc}") from exc
    weights = {}
    for name, hf_name in hf_names(config).items():
        if hf_name not in tensors:
            raise CheckpointError(f"{folder} lacks the Whisper weight {hf_name!r}")
        weights[name] = tensors[hf_name].to(torch.float32)
    extra = dict(hf)
    generation = folder / "generation_config.json"
    if generation.is_file():
        extra.update(read_json_object(generation, "generation config", CheckpointError))
    return config, weights, extra
