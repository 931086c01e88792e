"""Which model a run loads and how (``LoadSettings``): one record passed from the CLI through the batch
runner to this process or to each Ray actor. Its own room, above ``api`` (whose ``load`` it calls)
and below the CLI and the integrations that pass it around."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoadSettings:
    """Which model a run loads and how: the arguments of ``fastdecode.load``, passed as one record
    from the CLI through the batch runner to this process or to each Ray actor."""

    model: str | None = None  # HF folder or .gguf file; None: the embedded model
    device: str = "cpu"
    dtype: str = "float32"
    quantize: str | None = None
    prompt_rows: str | None = None  # "int8-mlp" (None) | "exact" | "int8": how prompt rows of quantized weights are multiplied

    def load(self) -> Any:
        from .api import load

        return load(self.model, device=self.device, dtype=self.dtype, quantize=self.quantize,
                    prompt_rows=self.prompt_rows)
