"""Read a GGUF file: metadata, tensor table and raw tensor bytes, memory-mapped.

Why not ``gguf.GGUFReader``: it builds a numpy memmap object for every element of every
metadata array, which takes about 2.6 s for SmolLM2's 98k tokenizer strings (the whole cold
start budget is 5 s). The container format is small and stable, so the header is parsed here
with ``struct`` (about 0.1 s); blocks without a kernel are still decoded by the ``gguf`` package
(``gguf.quants.dequantize``), whose job that is.

Format (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64,
metadata key/value pairs, tensor infos (name, dims in ggml order, type, offset), padding to
``general.alignment``, then tensor data.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types (gguf spec): code -> struct format for scalars.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY_DTYPES = {0: "u1", 1: "i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
LAZY_STRINGS = 4096  # string arrays at least this long (vocabularies, merges) are decoded when read


# ggml type code -> (name, elements per block, bytes per block) for the types a load reads without
# the ``gguf`` package (importing it costs 0.1-0.3 s: it pulls in yaml and its metadata helpers);
# other codes are looked up in ``gguf.constants`` when a file has them.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): reversed ggml dims
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:  # "Q4_K", "F32"...
        return ggml_type(self.ggml_type, self.name)[0]


class GGUFFile:
    """A parsed GGUF file. ``metadata`` holds plain Python values; tensors stay on disk (mmap)."""

    def __init__(self, path: str | Path, string_array_ends: dict[int, int] | None = None):
        """string_array_ends: where each long string array (by the offset of its first string) ends, as
        ``self.string_array_ends`` found it in an earlier parse of this very file (the weight cache keeps
        them): those arrays are skipped, their strings found when one is read (and checked then)."""
        self.path = Path(path)
        self._known_ends = string_array_ends or {}
        self.string_array_ends: dict[int, int] = {}
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read GGUF file {self.path}: {exc}") from exc
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, OverflowError, ValueError) as exc:
            raise CheckpointError(f"corrupt or truncated GGUF file {self.path}: {exc}") from exc

    # -- parsing -----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise CheckpointError(f"{self.path} is not a GGUF file (bad magic {bytes(buf[:4])!r})")
        self.version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if self.version not in (2, 3):
            raise CheckpointError(f"{self.path}: unsupported GGUF version {self.version}")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._read_value(value_type)

        infos = []
        for _ in range(n_tensors):
            name = self._read_string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), ggml_type, offset))

        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            # as llama.cpp: anything else would place every tensor at a wrong offset (or divide by 0)
            raise CheckpointError(f"{self.path}: general.alignment must be a power of two, got {alignment!r}")
        data_start = (self._pos + alignment - 1) // alignment * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            nbytes = _tensor_nbytes(dims, ggml_type, name)
            start = data_start + offset
            if start + nbytes > len(buf):
                raise CheckpointError(
                    f"truncated GGUF file {self.path}: tensor {name!r} needs bytes up to {start + nbytes}, "
                    f"file has {len(buf)}"
                )
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _read_string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + length
        if self._pos > len(self._map):
            raise ValueError("string runs past the end of the file")
        return self._map[start : self._pos].decode("utf-8")

    def _read_strings(self, count: int) -> list[str] | StringArray:
        """A string array: where each string is, found in one tight loop; from ``LAZY_STRINGS`` strings on (a
        vocabulary: 49,152 tokens and 48,900 merges for SmolLM2, 262,144 tokens for Gemma 3) a ``StringArray``,
        whose strings are decoded when read, else the decoded list."""
        start = self._pos
        if count >= LAZY_STRINGS and self._known_ends.get(start, len(self._map) + 1) <= len(self._map):
            self._pos = self.string_array_ends[start] = self._known_ends[start]
            return StringArray(self._map, None, self.path, start, count, self._pos)
        heads = string_heads(self._map, start, count)
        self._pos = heads[count]
        array = StringArray(self._map, heads, self.path)
        if count < LAZY_STRINGS:
            return array.strings()
        self.string_array_ends[start] = self._pos
        return array

    def _read_value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._unpack("<" + _SCALAR_FORMATS[value_type])[0]
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            item_type, count = self._unpack("<IQ")
            if item_type in _NUMPY_DTYPES:  # numeric arrays: one vectorized read
                dtype = np.dtype(_NUMPY_DTYPES[item_type])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += dtype.itemsize * count
                return values.tolist()
            if item_type == _STRING:
                return self._read_strings(count)
            return [self._read_value(item_type) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {value_type}")

    # -- tensors -----------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 array of shape [rows..., bytes_per_row] (zero-copy)."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        rows = info.shape[:-1]
        return data.reshape(*rows, -1) if rows else data.reshape(1, -1)

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32 in numpy order (F32: a read-only view of the file); quantized blocks
        of a type the kernels run are decoded by the kernels' decoder (bit-identical to ``gguf.quants``,
        whose pure-numpy decoding takes ~10x as long: minutes for a 1.5B model), others by ``gguf.quants``."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.type_name == "F32":
            values = raw.view("<f4")
        elif info.type_name == "F16":
            values = raw.view("<f2").astype(np.float32)
        elif info.type_name == "BF16":  # bf16 -> f32: place the 16 bits high
            values = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        elif info.type_name in _kernel_types():
            values = _kernel_decoded(info.type_name, raw, info.shape)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            qtype = GGMLQuantizationType(info.ggml_type)
            try:
                values = dequantize(raw, qtype)
            except NotImplementedError as exc:
                raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported type {qtype.name}") from exc
        return values.reshape(info.shape)


def _kernel_types():
    """The block types the kernels run (gguf_blocks.REPACKERS; imported when a tensor is decoded: torch)."""
    from .gguf_blocks import REPACKERS

    return REPACKERS


def _kernel_decoded(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Blocks [rows..., bytes per row] of a tensor of ``shape`` -> float32 [rows, K], through the kernels'
    repacker and decoder (as many threads as torch's)."""
    import torch

    from ..layers.quantized import dense_weight
    from .gguf_blocks import repack

    rows, K = int(np.prod(shape[:-1])), shape[-1]  # a 1-D tensor is one row
    weight = repack(type_name, raw.reshape(rows, -1), (rows, K))  # raw: [rows, bytes per row]
    return dense_weight(weight, work=rows * K, threads=torch.get_num_threads()).numpy()  # [rows, K]


def string_heads(buf: mmap.mmap, start: int, count: int) -> list[int]:
    """Where each of ``count`` strings from ``start`` has its length field, then where the array ends."""
    pos, unpack_length = start, _LENGTH.unpack_from
    heads = [0] * (count + 1)
    for index in range(count):
        heads[index] = pos
        pos += 8 + unpack_length(buf, pos)[0]
    if pos > len(buf):
        raise ValueError("string array runs past the end of the file")
    heads[count] = pos
    return heads


class StringArray(Sequence[str]):
    """A metadata string array left in the memory map, each string decoded from UTF-8 when read.

    A load whose tokenizer comes from the cache (tokenizer/cache.py) reads a few of a vocabulary's
    strings, not all of them (decoding SmolLM2's 98,000 cost 11 ms of its load). Iterating decodes every
    string once and keeps them. Equal to any sequence of the same strings."""

    __slots__ = ("_buf", "_heads", "_path", "_strings", "_span")

    def __init__(self, buf: mmap.mmap, heads: list[int] | None, path: Path, start: int = 0, count: int = 0,
                 end: int = 0):
        """heads: the length fields' offsets, then the end; None: found when first needed, from the
        array's (start, count, end) (a skipped array: ``GGUFFile``'s string_array_ends)."""
        self._buf, self._heads, self._path = buf, heads, path
        self._span = (start, count, end)
        self._strings: list[str] | None = None

    def __len__(self) -> int:
        return self._span[1] if self._heads is None else len(self._heads) - 1

    def _found_heads(self) -> list[int]:
        if self._heads is None:
            start, count, end = self._span
            try:
                heads = string_heads(self._buf, start, count)
            except (ValueError, struct.error) as exc:
                raise CheckpointError(f"corrupt GGUF file {self._path}: a string array ({exc})") from exc
            if heads[count] != end:
                raise CheckpointError(f"corrupt GGUF file {self._path}: a string array ends at {heads[count]}, "
                                      f"its recorded end is {end}")
            self._heads = heads
        return self._heads

    def __getitem__(self, index):
        if self._strings is not None or isinstance(index, slice):
            return self.strings()[index]
        index = range(len(self))[index]  # negative indices; IndexError past the end
        heads = self._found_heads()
        return self._decode(self._buf[heads[index] + 8 : heads[index + 1]], index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.strings())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and not isinstance(other, (str, bytes)) and self.strings() == list(other)

    __hash__ = None  # a sequence compared by value, as a list

    def strings(self) -> list[str]:
        """Every string, decoded once."""
        if self._strings is None:
            buf, heads = self._buf, self._found_heads()
            pieces = [buf[start + 8 : end] for start, end in zip(heads, heads[1:])]
            try:
                self._strings = list(map(bytes.decode, pieces))
            except UnicodeDecodeError:
                for index, piece in enumerate(pieces):
                    self._decode(piece, index)  # raises, naming the string
                raise
        return self._strings

    def _decode(self, piece: bytes, index: int) -> str:
        try:
            return piece.decode()
        except UnicodeDecodeError as exc:
            raise CheckpointError(
                f"corrupt GGUF file {self._path}: string {index} of an array is not UTF-8 ({exc})"
            ) from exc


def ggml_type(code: int, tensor: str) -> tuple[str, int, int]:
    """(type name, elements per block, bytes per block) of a ggml type code."""
    if code in GGML_TYPES:
        return GGML_TYPES[code]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType(code)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"tensor {tensor!r} has unknown ggml type {code}") from exc
    return qtype.name, block_size, type_size


def _tensor_nbytes(dims: tuple[int, ...], code: int, name: str) -> int:
    _, block_size, type_size = ggml_type(code, name)
    count = 1
    for d in dims:
        count *= d
    if dims and dims[0] % block_size:
        raise CheckpointError(f"tensor {name!r}: row length {dims[0]} is not a multiple of block {block_size}")
    return count // block_size * type_size
