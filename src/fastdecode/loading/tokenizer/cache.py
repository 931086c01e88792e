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

A cached entry is read on first use, not at load: parsing Qwen2.5's 151,643 tokens and merges takes about
0.5 s, a fifth of the process's start, and a caller that hands over token ids may never need it.
What the wrapper asks of the backend while it is built (the vocabulary's size, the ids of the
end-of-turn tokens a chat template writes, the spellings of the special ids) is written beside the
entry when it is saved (``<key>.facts.json``, from the backend itself) and answered from there;
anything else reads the entry then (``DeferredBackend``). An entry without its facts is read at once,
as before, and its facts written.
"""

from __future__ import annotations

import hashlib
import logging
import os
import json
import tempfile
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import tokenizers

from ...layers.kernels import cache_folder

log = logging.getLogger("fastdecode")
BUILDER_VERSION = "1"  # bump when from_gguf.py builds a different backend from the same metadata
MIN_CACHED_VOCABULARY = 32_768
FACTS_VERSION = 1  # of the .facts.json beside an entry


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
    gguf_path: Path | None, vocabulary_size: int, build: Callable[[], tokenizers.Tokenizer],
    texts: Iterable[str] = (), ids: Iterable[int] = (),
) -> tokenizers.Tokenizer | DeferredBackend:
    """The backend ``build()`` makes, read from the cache when this very file's was saved before: on first
    use (``DeferredBackend``) where the entry's facts (``token_to_id`` of ``texts``, ``id_to_token`` of ``ids``
    and the vocabulary's size) were saved beside it."""
    where = cache_file(gguf_path) if gguf_path is not None and vocabulary_size >= MIN_CACHED_VOCABULARY else None
    if where is None:
        return build()
    texts, ids = list(texts), list(ids)
    facts = _read_facts(where)
    if facts is not None and covers(facts, texts, ids) and where.is_file():
        return DeferredBackend(lambda: _read_or_build(where, build), facts)
    backend = _read_or_build(where, build)
    _write(_facts_file(where), json.dumps(backend_facts(backend, texts, ids)))
    return backend


def backend_facts(backend: tokenizers.Tokenizer, texts: list[str], ids: list[int]) -> dict:
    """What ``DeferredBackend`` answers without reading the entry, asked of the backend itself: the ids
    of ``texts``, and the spellings of ``ids`` and of those ids."""
    token_ids = {text: backend.token_to_id(text) for text in texts}
    spelled = [*ids, *(i for i in token_ids.values() if i is not None)]
    return {"version": FACTS_VERSION, "vocab_size": backend.get_vocab_size(with_added_tokens=True),
            "token_ids": token_ids, "tokens": {str(i): backend.id_to_token(i) for i in spelled}}


def covers(facts: dict, texts: list[str], ids: list[int]) -> bool:
    """Whether ``facts`` answer every question about ``texts`` and ``ids``."""
    return all(text in facts["token_ids"] for text in texts) and all(str(i) in facts["tokens"] for i in ids)


class DeferredBackend:
    """A cached ``tokenizers.Tokenizer`` read on first use. The wrapper's questions at construction
    (``get_vocab_size``, ``token_to_id`` / ``id_to_token`` of what the facts hold, ``no_padding``,
    ``no_truncation``) are answered without it; any other attribute reads it (once, under a lock) and
    is the real backend's."""

    def __init__(self, read: Callable[[], tokenizers.Tokenizer], facts: dict) -> None:
        self._read, self._facts, self._backend = read, facts, None
        self._lock = threading.Lock()

    def resolve(self) -> tokenizers.Tokenizer:
        """The backend itself (read now if it was not yet)."""
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    backend = self._read()
                    backend.no_padding()  # what the wrapper asked of it (cache entries hold neither anyway)
                    backend.no_truncation()
                    self._backend = backend
        return self._backend

    @property
    def is_read(self) -> bool:
        return self._backend is not None

    def no_padding(self) -> None:
        if self._backend is not None:
            self._backend.no_padding()

    def no_truncation(self) -> None:
        if self._backend is not None:
            self._backend.no_truncation()

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        if with_added_tokens and self._backend is None:
            return self._facts["vocab_size"]
        return self.resolve().get_vocab_size(with_added_tokens=with_added_tokens)

    def token_to_id(self, text: str) -> int | None:
        known = self._facts["token_ids"]
        return known[text] if self._backend is None and text in known else self.resolve().token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        known = self._facts["tokens"]
        key = str(token_id)
        return known[key] if self._backend is None and key in known else self.resolve().id_to_token(token_id)

    def __getattr__(self, name: str):  # only for names not defined here: everything else the backend has
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __reduce__(self):  # pickles as the backend it stands for
        return tokenizers.Tokenizer.from_str, (self.resolve().to_str(),)


def _read_or_build(where: Path, build: Callable[[], tokenizers.Tokenizer]) -> tokenizers.Tokenizer:
    if where.is_file():
        try:
            return tokenizers.Tokenizer.from_file(str(where))
        except Exception as exc:  # a damaged entry: build, and write it again
            log.info("fastdecode: ignoring the unreadable cached tokenizer %s (%s)", where, exc)
    backend = build()
    _write(where, backend.to_str())
    return backend


def _facts_file(where: Path) -> Path:
    return where.with_name(where.stem + ".facts.json")


def _read_facts(where: Path) -> dict | None:
    try:
        facts = json.loads(_facts_file(where).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    valid = (isinstance(facts, dict) and facts.get("version") == FACTS_VERSION and isinstance(facts.get("vocab_size"), int)
             and isinstance(facts.get("token_ids"), dict) and isinstance(facts.get("tokens"), dict))
    return facts if valid else None


def _write(where: Path, text: str) -> None:
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=where.parent, suffix=".part", delete=False, encoding="utf-8") as part:
            part.write(text)
        os.replace(part.name, where)  # atomic: a reader sees a whole entry or none
    except OSError as exc:
        log.info("fastdecode: cannot cache the tokenizer in %s (%s)", where.parent, exc)
