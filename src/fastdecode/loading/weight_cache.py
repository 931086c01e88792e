"""An on-disk cache of a GGUF file's weights as the kernels hold them, mapped by later loads.

Repacking a GGUF's K-quant blocks into the kernels' layout (gguf_blocks.py) and fusing each block's
products (layers/fused.py) cost about 8 CPU seconds for a 1.5B model; both are the same on every
load of the same file. The first native load writes the built model's weights here, every storage
once, in the layout the model holds them (fused Q/K/V and gate/up matrices included); later loads
map the file (copy-on-write, so every process loading it shares the same page-cache pages) and
make each weight a view of the mapping: no repacking, no copy, and only the pages a step reads
become resident (an embedding table's rows as they are looked up).

Entry name: a hash of the GGUF's resolved path, the version of the code that decides the bytes (a hash
of the sources of the repacker, the quantized layout, the GGUF loader, the families' modules and this
file), and a hash of the whole identity (path, size, inode, modification and change times, a hash of
its first MiB, the load's dtype, that version): a GGUF file changed in any way, or a new repacker,
misses and is repacked again. Saving an entry removes the path's entries for its earlier contents and
keeps one made by another code version (another install or source tree loading the same file).

An entry is checked before use: its header (magic, format version, a hash of the index, the
identity it was made for) and its size; its modification time is set to a value written in its
header, so a write into the entry after it was made (which moves that time) is detected too. A
damaged entry is logged and rebuilt; an entry is never used for another file. The entries live in
``weights`` beside the kernels' cache (``FASTDECODE_CACHE``, default ``~/.cache/fastdecode``), or in
``FASTDECODE_WEIGHT_CACHE``; either set to ``off`` turns the cache off. Files under ``MIN_CACHED_BYTES``
are not cached (their repacking takes milliseconds).

File format: b"FDWEIGHT", u32 format version, u64 index length, the index (JSON), then each storage's
bytes at a page-aligned offset. The index: identity, mtime_ns, file size, storages [[offset, bytes]],
and per canonical weight a tensor (storage, dtype, element offset, shape, stride) or a quantized
weight (its fields, and codes / scale / mins as tensors).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
import weakref
from pathlib import Path

import torch

from ..layers.kernels import cache_folder
from ..layers.quantized import QuantizedWeight

log = logging.getLogger("fastdecode")
MAGIC = b"FDWEIGHT"
FORMAT_VERSION = 2  # 2: compact K-quant scales (layers/kscales.py)
PAGE = 4096
_PREAMBLE = struct.Struct("<8sIQ")  # magic, format version, index length
MIN_CACHED_BYTES = 32 << 20  # smaller GGUF files (tests' tiny models) repack in milliseconds: not cached
ABANDONED_SECONDS = 3600  # a partial entry untouched this long was left by a writer that died
HASHED_BYTES = 1 << 20  # the GGUF's first MiB (header, metadata, the first tensors) joins its identity
KEPT_OTHER_VERSIONS = 1  # entries of a GGUF path kept for other code versions than the one saving
# what decides the cached bytes besides the GGUF: their sources' hash is part of every entry's name
_LAYOUT_SOURCES = ("loading/gguf_blocks.py", "loading/gguf.py", "layers/quantized.py", "loading/weight_cache.py")
_QUANTIZED_FIELDS = ("kind", "bits", "group", "transposed", "activation_bits", "outputs", "exact_prompt_rows")


# entry path -> (its (inode, mtime_ns), its mapping), while a loaded model's tensors hold the mapping:
# loading the same entry again in this process maps the same pages (no second mapping, no growth of RSS)
_MAPPED: dict[Path, tuple[tuple[int, int], weakref.ref]] = {}


class StaleCacheEntry(Exception):
    """A cache entry that is damaged or was made for other input: rebuilt, never used."""


def cache_root() -> Path | None:
    """The entries' folder: ``FASTDECODE_WEIGHT_CACHE``, else ``weights`` in the kernels' cache folder."""
    root = cache_folder()
    if root is None or os.environ.get("FASTDECODE_WEIGHT_CACHE") == "off":
        return None
    return Path(os.environ.get("FASTDECODE_WEIGHT_CACHE") or root / "weights")


@functools.cache
def _code_version() -> str:
    """A hash of the sources that decide an entry's bytes: the repacker, the layouts, the loader, this file
    and the families' modules (their GGUF -> HF layout functions)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(str(FORMAT_VERSION).encode())
    for source in [package / name for name in _LAYOUT_SOURCES] + sorted((package / "models").glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def gguf_identity(path: Path, dtype: torch.dtype) -> dict:
    """What an entry must have been made from: the file (as stat sees it, and its first ``HASHED_BYTES``),
    the load's dtype and the layout code's version."""
    resolved = path.resolve()
    with open(resolved, "rb") as handle:
        stat = os.fstat(handle.fileno())
        head = handle.read(HASHED_BYTES)
    return {"path": str(resolved), "size": stat.st_size, "inode": stat.st_ino, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns, "head_sha256": hashlib.sha256(head).hexdigest(), "dtype": str(dtype),
            "code": _code_version(), "torch": torch.__version__}


def entry_path(identity: dict) -> Path | None:
    """The entry's path (None with the cache off, or for a file too small to gain from it): named by
    the GGUF's path, then by the whole identity, so that saving a new entry for a path can remove the
    entries of that path's earlier contents."""
    root = cache_root()
    if root is None or identity["size"] < MIN_CACHED_BYTES:
        return None
    of_path = hashlib.sha256(identity["path"].encode()).hexdigest()[:16]
    of_identity = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{of_path}-{identity['code']}-{of_identity}.fdw"


def _made_at(entry: Path) -> int:
    """When an entry was written (its modification time, which ``save`` sets; 0 if it is gone)."""
    try:
        return entry.stat().st_mtime_ns
    except OSError:
        return 0


def _remove_older_entries(where: Path) -> None:
    """Remove the entries of the same GGUF path made by this code version for its earlier contents, and those
    made by other code versions but the newest (``KEPT_OTHER_VERSIONS``): a second install or source tree
    beside this one keeps its entry, so that two of them loading the same file in turn (a before/after
    benchmark) map their entries instead of repacking at every load; a process mapping a removed entry
    keeps its pages. Also the partial files of writers that died (untouched for an hour: a live writer's
    file grows)."""
    of_path, code = (where.name.split("-") + ["", ""])[:2]  # (a name outside entry_path's scheme: no others)
    others = [other for other in where.parent.glob(f"{of_path}-*.fdw") if other != where] if code else []
    other_codes = [other for other in others if len(other.name.split("-")) == 3 and other.name.split("-")[1] != code]
    kept = sorted(other_codes, key=_made_at, reverse=True)[:KEPT_OTHER_VERSIONS]
    stale = [other for other in others if other not in kept]
    for other in stale + list(where.parent.glob("*.part")):
        try:
            if other.suffix == ".fdw" or time.time() - other.stat().st_mtime > ABANDONED_SECONDS:
                other.unlink()
        except OSError:
            pass


# -- writing ------------------------------------------------------------------------------------

def save(where: Path, identity: dict, weights: dict[str, torch.Tensor | QuantizedWeight],
         string_array_ends: dict[int, int]) -> None:
    """Write ``weights`` (CPU tensors and quantized weights, as the built model holds them) to ``where``:
    every storage once, each weight described as a view of one; and the GGUF's long string arrays' ends
    (``GGUFFile.string_array_ends``: a later parse skips them). Atomic (a temporary name, then a rename);
    a failure is logged and leaves no entry."""
    storages: dict[int, torch.UntypedStorage] = {}  # data pointer -> storage, in order of first use
    numbers: dict[int, int] = {}  # data pointer -> its storage's number in the file

    def describe(tensor: torch.Tensor) -> list:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in numbers:
            numbers[key], storages[key] = len(numbers), storage
        return [numbers[key], str(tensor.dtype).removeprefix("torch."), tensor.storage_offset(), list(tensor.shape),
                list(tensor.stride())]

    index: dict[str, dict] = {}
    for name, weight in weights.items():
        if isinstance(weight, QuantizedWeight):
            fields = {field: getattr(weight, field) for field in _QUANTIZED_FIELDS}
            fields["dtype"] = str(weight.dtype).removeprefix("torch.")
            fields.update({part: None if getattr(weight, part) is None else describe(getattr(weight, part))
                           for part in ("codes", "scale", "mins")})
            index[name] = {"quantized": fields}
        else:
            index[name] = {"tensor": describe(weight)}
    layout, offset = [], 0
    for storage in storages.values():
        layout.append([offset, storage.nbytes()])
        offset = -(-(offset + storage.nbytes()) // PAGE) * PAGE
    mtime_ns = time.time_ns()
    header = {"identity": identity, "mtime_ns": mtime_ns, "storages": layout, "weights": index, "data_bytes": offset,
              "string_array_ends": {str(start): end for start, end in string_array_ends.items()}}
    body = json.dumps(header, sort_keys=True).encode()
    body_hash = hashlib.sha256(body).digest()
    data_start = _data_start(len(body))
    header_bytes = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(body)) + body_hash + body
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("wb", dir=where.parent, suffix=".part", delete=False) as part:
            part.write(header_bytes.ljust(data_start, b"\0"))
            for (start, nbytes), storage in zip(layout, storages.values()):
                part.seek(data_start + start)
                part.write(memoryview(torch.empty(0, dtype=torch.uint8).set_(storage).numpy()))
            part.truncate(data_start + offset)
        os.utime(part.name, ns=(mtime_ns, mtime_ns))
        os.replace(part.name, where)  # a reader sees a whole entry or none
        _remove_older_entries(where)
    except OSError as exc:
        log.info("fastdecode: cannot cache the repacked weights in %s (%s)", where.parent, exc)
        try:
            os.unlink(part.name)
        except (OSError, NameError):
            pass


def _data_start(index_bytes: int) -> int:
    """Where the storages begin: after the preamble, the index's hash and the index, at a page."""
    return -(-(_PREAMBLE.size + 32 + index_bytes) // PAGE) * PAGE


# -- reading ------------------------------------------------------------------------------------

def load(where: Path, identity: dict) -> tuple[dict[str, torch.Tensor | QuantizedWeight], dict[int, int]]:
    """(the weights of the entry at ``where``, each a view of one copy-on-write mapping of the file; the
    GGUF's string arrays' ends, for ``GGUFFile``). Raises ``FileNotFoundError`` without an entry,
    ``StaleCacheEntry`` for a damaged entry or one made from other input."""
    with open(where, "rb") as handle:
        stat = os.fstat(handle.fileno())
        preamble = handle.read(_PREAMBLE.size + 32)
        if len(preamble) < _PREAMBLE.size + 32:
            raise StaleCacheEntry("shorter than its header")
        magic, version, length = _PREAMBLE.unpack_from(preamble)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise StaleCacheEntry(f"bad magic or format version ({magic!r}, {version})")
        body = handle.read(length)
        if len(body) != length or hashlib.sha256(body).digest() != preamble[_PREAMBLE.size:]:
            raise StaleCacheEntry("its index does not match its hash")
        header = json.loads(body)
        if header["identity"] != identity:
            raise StaleCacheEntry("made from another file")
        data_start = _data_start(length)
        if stat.st_size != data_start + header["data_bytes"]:
            raise StaleCacheEntry(f"{stat.st_size} bytes, expected {data_start + header['data_bytes']}: "
                                  "truncated or grown")
        if stat.st_mtime_ns != header["mtime_ns"]:
            raise StaleCacheEntry("modified after it was written")
        base = _mapping(where, handle, stat)
    storage = base.untyped_storage()

    views: dict[str, torch.Tensor] = {}  # a description's text -> its tensor: what was one tensor (a tied
    # table's codes under two names) is one tensor again

    def view(description: list | None) -> torch.Tensor | None:
        if description is None:
            return None
        key = json.dumps(description)
        if key not in views:
            index, dtype_name, element_offset, shape, stride = description
            dtype = getattr(torch, dtype_name)
            start = data_start + header["storages"][index][0]
            views[key] = torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize + element_offset, shape,
                                                          stride)
        return views[key]

    def weight(entry: dict) -> torch.Tensor | QuantizedWeight:
        if "tensor" in entry:
            return view(entry["tensor"])
        fields = dict(entry["quantized"])
        fields["dtype"] = getattr(torch, fields["dtype"])
        tensors = {part: view(fields.pop(part)) for part in ("codes", "scale", "mins")}
        return QuantizedWeight(**fields, **tensors)

    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    made: dict[str, torch.Tensor | QuantizedWeight] = {}  # an entry's text -> its object: tied names stay one object
    for name, entry in header["weights"].items():
        key = json.dumps(entry, sort_keys=True)
        if key not in made:
            made[key] = weight(entry)
        weights[name] = made[key]
    return weights, {int(start): end for start, end in header["string_array_ends"].items()}


def _mapping(where: Path, handle, stat: os.stat_result) -> torch.Tensor:
    """The entry's bytes as a uint8 tensor over a private (copy-on-write) mapping of the file: the one
    an earlier load of this very file made where a model still holds it, else a new one."""
    version = (stat.st_ino, stat.st_mtime_ns)
    known, alive = _MAPPED.get(where, (None, lambda: None))
    mapped = alive() if known == version else None
    if mapped is None:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # private: never writes the file
        _MAPPED[where] = (version, weakref.ref(mapped))
    return torch.frombuffer(mapped, dtype=torch.uint8)  # [file bytes]; its storage keeps the mapping alive
