"""CTranslate2's ``model.bin``, read lazily from a memory map (no ctranslate2 import).

The format (CTranslate2's ``model_spec.py`` writes it, ``models/model.cc`` reads it), all
little-endian: ``uint32`` binary version; from version 2 the spec name (a string) and its
``uint32`` revision; ``uint32`` variable count, then per variable its name (string), ``uint8``
rank, ``uint32`` dims, ``uint8`` dtype (from version 4; an item size before) and ``uint32`` byte
count followed by the raw data; from version 3 a ``uint32`` alias count and (alias, variable) name
pairs. A string is a ``uint16`` length (counting its trailing NUL), the UTF-8 bytes and the NUL.

Only the header is parsed at open: each tensor is a view of the mapped file until it is asked for.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import CheckpointError

# The DataType enum of CTranslate2's include/ctranslate2/types.h, in its order.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: "bfloat16"}
SUPPORTED_VERSIONS = range(4, 7)


@dataclass(frozen=True)
class TensorEntry:
    dtype: object  # numpy dtype, or "bfloat16"
    shape: tuple[int, ...]
    offset: int  # of the data in the file
    nbytes: int


class CTranslate2File:
    """The named tensors of one ``model.bin``: ``spec``, ``revision``, ``names()``, ``tensor(name)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
            raise CheckpointError(f"cannot read {self.path}: {exc}") from exc
        self._pos = 0
        self.entries: dict[str, TensorEntry] = {}
        self.aliases: dict[str, str] = {}
        self._parse()

    # -- header -------------------------------------------------------------------------------
    def _take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._pos + size > len(self._map):
            raise CheckpointError(f"{self.path} is truncated (header ends at byte {len(self._map)})")
        values = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += size
        return values if len(values) > 1 else values[0]

    def _string(self) -> str:
        length = self._take("H")
        end = self._pos + length
        if length == 0 or end > len(self._map) or self._map[end - 1] != 0:
            raise CheckpointError(f"{self.path}: a malformed name at byte {self._pos} (not a CTranslate2 model.bin?)")
        text = bytes(self._map[self._pos : end - 1]).decode("utf-8", errors="replace")
        self._pos = end
        return text

    def _parse(self) -> None:
        self.version = self._take("I")
        if self.version not in SUPPORTED_VERSIONS:
            raise CheckpointError(f"{self.path}: CTranslate2 binary version {self.version} is not supported "
                                  f"(supported: {SUPPORTED_VERSIONS.start}..{SUPPORTED_VERSIONS.stop - 1})")
        self.spec = self._string()
        self.revision = self._take("I")
        count = self._take("I")
        for _ in range(count):
            name = self._string()
            rank = self._take("B")
            shape = tuple(self._take("I") for _ in range(rank))
            type_id, nbytes = self._take("B"), self._take("I")
            if type_id not in _DTYPES:
                raise CheckpointError(f"{self.path}: variable {name!r} has unknown dtype id {type_id}")
            dtype = _DTYPES[type_id]
            itemsize = 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize
            if nbytes != itemsize * int(np.prod(shape, dtype=np.int64)):
                raise CheckpointError(f"{self.path}: variable {name!r} of shape {shape} holds {nbytes} bytes")
            if self._pos + nbytes > len(self._map):
                raise CheckpointError(f"{self.path} is truncated: variable {name!r} runs past the end of the file "
                                      f"({self._pos + nbytes} > {len(self._map)} bytes)")
            self.entries[name] = TensorEntry(dtype, shape, self._pos, nbytes)
            self._pos += nbytes
        for _ in range(self._take("I")):
            alias = self._string()
            self.aliases[alias] = self._string()

    # -- tensors ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        return [*self.entries, *self.aliases]

    def __contains__(self, name: str) -> bool:
        return name in self.entries or name in self.aliases

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[self.aliases.get(name, name)].shape

    def tensor(self, name: str) -> torch.Tensor:
        """The variable as a tensor viewing the mapped file (read-only memory: copy before writing).
        A scalar stored with rank 0 comes back with shape ()."""
        target = self.aliases.get(name, name)
        if target not in self.entries:
            raise CheckpointError(f"{self.path} has no variable {name!r}")
        entry = self.entries[target]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)
        if entry.dtype == "bfloat16":
            return torch.frombuffer(raw, dtype=torch.bfloat16).reshape(entry.shape) if entry.nbytes else \
                torch.empty(entry.shape, dtype=torch.bfloat16)
        with warnings.catch_warnings():  # read-only memory: the loader converts (copies) before any write
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(raw.view(entry.dtype).reshape(entry.shape))  # a view of the map
