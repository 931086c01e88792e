"""An on-disk cache of tokenizers built from GGUF vocabularies, keyed by the file's identity.

Building Gemma 3's tokenizer (262,144 tokens, about 513,000 merges derived from scores) is most of
its load time; ``tokenizers`` reads the same tokenizer back from its own JSON in about half that.
The key is the GGUF file's resolved path, size, inode, modification and change times (the change
time moves whenever the file's content or metadata does, and cannot be set back), the builder's
version and the ``tokenizers`` version: a file that changed in any way misses, and a file the
cache cannot read or write is built as if there were no cache. In a fresh process SmolLM2's 49,152
tokens and 48,900 merges also read back faster (about 70 ms) than they build (about 130 ms: part of
the 1 s load budget); only small vocabularies (tests' tiny ones) build faster than they read back
and are not cached. ``FASTDECODE_CACHE`` moves the folder (as for the kernels);
``FASTDECODE_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import tokenizers

from ...layers.kernels import cache_folder

log = logging.getLogger("fastdecode")
BUILDER_VERSION = "1"  # bump when from_gguf.py builds a different backend from the same metadata
MIN_CACHED_VOCABULARY = 32_768


def cache_file(gguf_path: Path) -> Path | None:
    """Where the tokenizer of ``gguf_path`` is cached, or None when the cache is off or the file unreadable."""
    root = cache_folder()
    if root is None:
        return None
    try:
        path = gguf_path.resolve()
        stat = path.stat()
    except OSError:
        return None
    identity = "|".join(map(str, (path, stat.st_size, stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns,
                                  BUILDER_VERSION, tokenizers.__version__)))
    return Path(root) / "tokenizers" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def cached_backend(
    gguf_path: Path | None, vocabulary_size: int, build: Callable[[], tokenizers.Tokenizer]
) -> tokenizers.Tokenizer:
    """The backend ``build()`` makes, read from the cache when this very file's was saved before."""
    where = cache_file(gguf_path) if gguf_path is not None and vocabulary_size >= MIN_CACHED_VOCABULARY else None
    if where is not None and where.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(where))
        except Exception as exc:  # a damaged entry: build, and write it again
            log.info("fastdecode: ignoring the unreadable cached tokenizer %s (%s)", where, exc)
    backend = build()
    if where is not None:
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=where.parent, suffix=".part", delete=False,
                                             encoding="utf-8") as part:
                part.write(backend.to_str())
            os.replace(part.name, where)  # atomic: a reader sees a whole entry or none
        except OSError as exc:
            log.info("fastdecode: cannot cache the tokenizer in %s (%s)", where.parent, exc)
    return backend
