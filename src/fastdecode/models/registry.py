"""Architecture name -> model family, with the family module imported only when needed.

One registration per family. A family module provides: ``HF_NAMES`` and ``GGUF_NAMES``
(canonical weight name -> checkpoint name), ``IGNORED_NAME_PATTERNS``, ``weight_names(config)``,
``weight_shapes(config)`` (expected shapes, HF layout; checked at load), ``config_from_hf(dict)``,
``config_from_gguf(metadata, tensor_names)``, optionally ``gguf_shape_to_hf(name, shape)``,
``gguf_to_hf_layout(name, array, config)``, ``FLOAT32_WEIGHTS`` (GGUF tensors that are values, such
as RoPE factors, kept float32 whatever the dtype) and the model class named here. Encoder-decoder
families (``is_encoder_decoder``) have no GGUF form: their model class provides ``encode``,
``cross_kv`` and ``decode`` instead of ``forward`` (see engine/cross.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, UnsupportedModelError

if TYPE_CHECKING:  # pragma: no cover
    from ..layers.products import KernelChoice


@dataclass(frozen=True)
class Family:
    name: str
    module: str  # under fastdecode.models
    model_class: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    is_encoder_decoder: bool = False

    def load_module(self) -> ModuleType:
        return importlib.import_module(f"fastdecode.models.{self.module}")

    def build(self, config: Any, weights: dict, kernels: KernelChoice) -> Any:
        """The family's model over ``weights``; ``kernels``: its ``KernelChoice`` (layers/products.py)."""
        return getattr(self.load_module(), self.model_class)(config, weights, kernels)


# The one list of supported architectures: loaders, `fastdecode inspect`, `fastdecode --help` and the
# "unsupported architecture" error all read it. A new family is one entry here (and its module).
FAMILIES = (
    Family("llama", "llama", "LlamaModel",
           hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                             "GraniteForCausalLM", "SmolLM3ForCausalLM"),
           hf_model_types=("llama", "mistral", "qwen2", "qwen3", "granite", "smollm3"),
           gguf_architectures=("llama", "mistral", "qwen2", "qwen3", "granite", "smollm3")),
    Family("olmo2", "olmo2", "Olmo2Model",
           hf_architectures=("Olmo2ForCausalLM",),
           hf_model_types=("olmo2",),
           gguf_architectures=("olmo2",)),
    Family("gemma3", "gemma3", "Gemma3Model",
           hf_architectures=("Gemma3ForCausalLM",),
           hf_model_types=("gemma3_text",),
           gguf_architectures=("gemma3",)),
    # --- issue 34 (second half): Phi-3 / Phi-3.5 / Phi-4-mini and Gemma 2 ---
    Family("phi3", "phi3", "Phi3Model",
           hf_architectures=("Phi3ForCausalLM",),
           hf_model_types=("phi3",),
           gguf_architectures=("phi3",)),
    Family("gemma2", "gemma2", "Gemma2Model",
           hf_architectures=("Gemma2ForCausalLM",),
           hf_model_types=("gemma2",),
           gguf_architectures=("gemma2",)),
    # --- end of issue 34 (second half) ---
    Family("bloom", "bloom", "BloomModel",
           hf_architectures=("BloomForCausalLM",),
           hf_model_types=("bloom",),
           gguf_architectures=()),
    Family("gpt2", "gpt2", "GPT2Model",
           hf_architectures=("GPT2LMHeadModel",),
           hf_model_types=("gpt2",),
           gguf_architectures=("gpt2",)),
    Family("bart", "bart", "BartModel",
           hf_architectures=("BartForConditionalGeneration", "MBartForConditionalGeneration", "MarianMTModel"),
           hf_model_types=("bart", "mbart", "marian"),
           gguf_architectures=(),
           is_encoder_decoder=True),
    Family("t5", "t5", "T5Model",
           hf_architectures=("T5ForConditionalGeneration",),
           hf_model_types=("t5",),
           gguf_architectures=(),
           is_encoder_decoder=True),
    # --- issue 34, Phi-3 / Gemma 2: their entries go below this line -------------------------------
)


def supported_architectures() -> str:
    """The HF architectures (config.json ``architectures``) every loader accepts, comma-separated."""
    return ", ".join(a for f in FAMILIES for a in f.hf_architectures)


def supported_gguf_architectures() -> str:
    """The GGUF ``general.architecture`` names (llama.cpp's) the GGUF loader accepts, comma-separated."""
    return ", ".join(a for f in FAMILIES for a in f.gguf_architectures)


def family_by_name(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


def family_for_hf_config(hf_config: dict[str, Any]) -> Family:
    """Pick the family from ``architectures`` (first match) or else ``model_type``."""
    architectures = hf_config.get("architectures") or []
    model_type = hf_config.get("model_type")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise CheckpointError(f"config.json: architectures must be a list of strings, got {architectures!r}"[:300])
    if model_type is not None and not isinstance(model_type, str):
        raise CheckpointError(f"config.json: model_type must be a string, got {model_type!r}"[:300])
    for family in FAMILIES:
        if any(a in family.hf_architectures for a in architectures) or (
            not architectures and model_type in family.hf_model_types
        ):
            return family
    if model_type == "whisper" or any(a.startswith("Whisper") for a in architectures) or "suppress_ids" in hf_config:
        raise UnsupportedModelError("this is a Whisper speech-to-text model (a Hugging Face or CTranslate2 folder): "
                                    "load it with fastdecode.load_speech(path), or run `fastdecode transcribe`")
    named = ", ".join(architectures) or repr(model_type)
    raise UnsupportedModelError(
        f"unsupported architecture {named}; supported architectures: {supported_architectures()}"
    )


def family_for_gguf(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.gguf_architectures:
            return family
    raise UnsupportedModelError(
        f"unsupported GGUF architecture {architecture!r}; supported GGUF architectures: "
        f"{supported_gguf_architectures()}"
    )
