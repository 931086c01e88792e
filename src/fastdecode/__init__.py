"""fastdecode: a fast autoregressive decoding engine for transformer language models.

Public names only; heavy modules (torch models, loaders) are imported lazily so that
``import fastdecode`` stays light and never imports ``transformers``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import (
    BatchFileError,
    CheckpointError,
    FastDecodeError,
    InvalidOptionError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    TokenizerError,
    UnsupportedModelError,
)
from .heap import keep_freed_buffers

__version__ = "0.1.0"

__all__ = [
    "load",
    "load_speech",
    "from_hf",
    "Generator",
    "GenerationConfig",
    "FastDecodeError",
    "ModelNotFoundError",
    "CheckpointError",
    "UnsupportedModelError",
    "TokenizerError",
    "InvalidOptionError",
    "PromptTooLongError",
    "BatchFileError",
    "QueueFullError",
]

if TYPE_CHECKING:  # pragma: no cover
    from .api import Generator
    from .config import GenerationConfig
    from .speech.transcribe import Transcriber


def load(source: str | None = None, device: str = "cpu", dtype: str = "float32",
         quantize: str | None = None, speculative: Any = None, prompt_rows: str | None = None,
         kernels: Any = None) -> "Generator":
    """Load a model (HF folder, .gguf file, or the embedded default when None) into a Generator.

    quantize: None (a quantized GGUF runs on its own blocks; float checkpoints stay float), "int8" or
    "int4" (float matrices quantized at load), "dequantize" (GGUF blocks decoded to ``dtype``).
    speculative: the default speculative decoding of greedy and sampling calls: "ngram" (prompt
    lookup), ``{"draft_model": path}`` (a smaller model with the same tokenizer) or a dict of
    settings (fastdecode/config/speculative.py); outputs are the same, only faster.
    prompt_rows: how prompt rows (prompts, scored texts, encoder sources) of quantized weights are
    multiplied: "int8-mlp" (default: the MLP's products rounded to int8 and through the integer kernels,
    the attention's exact), "exact" (every product by the weights' exact float32 values) or "int8"
    (every product on the integer kernels, llama.cpp's choice: faster prompts, near ties may flip).
    kernels: instead of prompt_rows, the whole ``fastdecode.layers.products.KernelChoice`` (also the
    reference paths with the quantized or float kernels off, for tests and benchmarks)."""
    keep_freed_buffers()  # the forward's big activations reuse the heap's pages (fastdecode/heap.py)
    with _collector_paused():
        from .api import load as _load

        return _load(source, device=device, dtype=dtype, quantize=quantize, speculative=speculative,
                     prompt_rows=prompt_rows, kernels=kernels)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a model loads (then as it was): importing torch and
    building a model make a few hundred thousand objects that live on, and the collector walked them
    all again and again (~370 collections, 0.1-0.2 s of CPU of a Qwen 1.5B GGUF's ~1.7 s start)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def from_hf(hf_model: Any, tokenizer: Any = None, quantize: str | None = None, prompt_rows: str | None = None,
            kernels: Any = None) -> "Generator":
    """Wrap an in-memory ``transformers`` model (weights shared, not copied).

    quantize: None (float), or "int8" / "int4" (its float matrices quantized into new tables, as ``load``
    does; the model itself is left as it is); prompt_rows, kernels: as for ``load``."""
    from .api import from_hf as _from_hf

    keep_freed_buffers()
    return _from_hf(hf_model, tokenizer=tokenizer, quantize=quantize, prompt_rows=prompt_rows, kernels=kernels)


def load_speech(path: str, quantize: str | None = None) -> "Transcriber":
    """Load a Whisper folder (CTranslate2 ``model.bin`` or Hugging Face safetensors) into a
    ``Transcriber``: ``transcribe(audio, language=None, beam_size=5, ...)`` -> segments with times.
    ``quantize``: None (float32) or "int8" / "int4" (quantized at load)."""
    from .speech.loading import load_whisper
    from .speech.transcribe import Transcriber

    return Transcriber(load_whisper(path, quantize=quantize))


def __getattr__(name: str) -> Any:
    if name == "Generator":
        from .api import Generator

        return Generator
    if name == "GenerationConfig":
        from .config import GenerationConfig

        return GenerationConfig
    raise AttributeError(f"module 'fastdecode' has no attribute {name!r}")
