"""The GGUF load path reads lazily and copies nothing it need not; the tokenizer builder's fast paths
equal the plain ones.

Oracles: the ``gguf`` package (type table, the decoded values), a plain-Python reference of the
SentencePiece merge ranking, ``transformers``' GPT-2 byte table. No timings are asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight  # noqa: E402
from fastdecode.loading.gguf_file import GGML_TYPES, GGUFFile  # noqa: E402
from fastdecode.loading.tokenizer import IncrementalDetokenizer, Tokenizer, from_gguf  # noqa: E402
from tiny_gguf import MERGES, TOKEN_TYPES, TOKENS, write_gguf  # noqa: E402
from test_tokenizer_stream import _spm_fields  # noqa: E402


@pytest.fixture(scope="module")
def q4_1_file(tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("lazy") / "llama-Q4_1.gguf", "llama-gqa", QT.Q4_1)


def _mapped_range(gguf_file: GGUFFile) -> tuple[int, int]:
    start = np.frombuffer(gguf_file._map, dtype=np.uint8).ctypes.data
    return start, start + len(gguf_file._map)


def test_tensor_bytes_are_views_of_the_mapped_file(q4_1_file):
    """Parsing reads the header only; a tensor's bytes (and an F32 tensor's values) are read-only views
    into the memory map, so a page is read when a repacker touches it, and never copied before."""
    parsed = GGUFFile(q4_1_file)
    low, high = _mapped_range(parsed)
    for name, info in parsed.tensors.items():
        raw = parsed.raw(name)
        assert not raw.flags.owndata and not raw.flags.writeable
        assert low <= raw.ctypes.data and raw.ctypes.data + raw.nbytes <= high
        if info.type_name == "F32":
            values = parsed.dequantized(name)
            assert values.dtype == np.float32 and not values.flags.owndata
            assert low <= values.ctypes.data < high


def test_load_decodes_no_kernel_type_tensor_to_float(q4_1_file, monkeypatch):
    decoded = []
    real = GGUFFile.dequantized
    monkeypatch.setattr(GGUFFile, "dequantized", lambda self, name: decoded.append(name) or real(self, name))
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *args: pytest.fail("gguf.quants.dequantize was called"))
    gen = fastdecode.load(str(q4_1_file))
    parsed = GGUFFile(q4_1_file)
    assert decoded and all(len(parsed.tensors[name].shape) == 1 for name in decoded)  # norms only
    matrices = {name: w for name, w in gen.checkpoint.weights.items() if "norm" not in name}
    assert all(isinstance(w, QuantizedWeight) for w in matrices.values())
    held = {id(w.codes): w.nbytes for w in matrices.values()}  # a tied head shares its table
    assert sum(held.values()) <= sum(info.nbytes for info in parsed.tensors.values())


def test_loading_kernel_type_blocks_imports_neither_gguf_nor_transformers(q4_1_file):
    code = ("import sys, fastdecode; fastdecode.load(sys.argv[1]); "
            "sys.exit(sorted({'gguf', 'yaml', 'transformers'} & set(sys.modules)) or None)")
    result = subprocess.run([sys.executable, "-c", code, str(q4_1_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_ggml_type_table_is_the_gguf_packages():
    for code, (name, block_size, type_size) in GGML_TYPES.items():
        assert QT(code).name == name
        assert GGML_QUANT_SIZES[QT(code)] == (block_size, type_size)


# --- SentencePiece merges from scores ---------------------------------------------------------
def _reference_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal token into two vocabulary pieces, ranked by (-score, id, left id, right id)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    ranked = []
    for index, token in enumerate(tokens):
        if types[index] != 1 or vocab[token] != index:
            continue
        for cut in range(1, len(token)):
            left, right = vocab.get(token[:cut]), vocab.get(token[cut:])
            if left is not None and right is not None:
                ranked.append((-scores[index], index, left, right, token[:cut], token[cut:]))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _random_vocabulary(seed: int) -> tuple[list[str], list[float], list[int]]:
    rng = np.random.default_rng(seed)
    alphabet = list("ab▁é日🤗\x00")
    tokens = list(alphabet) + ["".join(rng.choice(alphabet, rng.integers(1, 9))) for _ in range(3000)]
    scores = np.round(rng.normal(size=len(tokens)), 1).tolist()  # many ties
    types = rng.choice([1, 1, 1, 1, 3, 4], len(tokens)).tolist()
    return tokens, scores, types


@pytest.mark.parametrize("seed", [0, 1])
def test_hashed_merges_equal_the_reference(seed, monkeypatch):
    tokens, scores, types = _random_vocabulary(seed)
    expected = _reference_merges(tokens, scores, types)
    assert len(expected) > 1000

    def merges() -> list[tuple[str, str]]:
        return from_gguf._merges_from_scores(tokens, np.asarray(scores), np.asarray(types),
                                             from_gguf._first_ids(tokens))

    plain = []
    real_plain = from_gguf._merges_by_lookup
    monkeypatch.setattr(from_gguf, "_merges_by_lookup", lambda *args: plain.append(1) or real_plain(*args))
    assert merges() == expected and not plain  # the hashed path
    monkeypatch.setattr(from_gguf, "_HASH_BASE", np.uint64(1))  # hash = sum of code points: collisions
    assert merges() == expected and len(plain) == 1
    monkeypatch.setattr(from_gguf, "_MAX_CODE_POINTS", 0)  # too long to hold as an array
    assert merges() == expected and len(plain) == 2


# --- byte-level vocabularies --------------------------------------------------------------------
def test_byte_level_spelling_is_gpt2s_byte_table():
    convert = pytest.importorskip("transformers.convert_slow_tokenizer")
    table = convert.bytes_to_unicode()
    assert from_gguf._BYTE_ALPHABET == frozenset(table.values())
    for text in ("a b\n", "\x00\x7f é", "日本 🤗", "\t\r\n  x"):
        assert from_gguf._byte_level_spelling(text) == "".join(table[b] for b in text.encode())


def test_a_normal_token_stored_as_raw_utf8_is_respelled():
    spelled = from_gguf._byte_level_spelling("日")  # three byte characters
    fields = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": TOKENS + [spelled[:2], "日"],  # "日" raw UTF-8, not as BPE spells it
        "tokenizer.ggml.token_type": TOKEN_TYPES + [1, 1],
        "tokenizer.ggml.merges": MERGES + [f"{spelled[0]} {spelled[1]}", f"{spelled[:2]} {spelled[2]}"],
    }
    tokenizer = Tokenizer.from_gguf_fields(fields)
    assert tokenizer.encode("日", add_special_tokens=False) == [len(TOKENS) + 1]
    assert tokenizer.decode([len(TOKENS) + 1]) == "日"


# --- streaming ---------------------------------------------------------------------------------
def test_stream_goes_on_where_decode_stream_gives_up():
    """A valid byte, then an invalid run: ByteFallback turns the emitted "9" into U+FFFD afterwards,
    which DecodeStream reports as an error; the stream decodes that step itself and goes on."""
    spm = Tokenizer.from_gguf_fields(_spm_fields())
    byte = {b: spm.token_to_id(f"<0x{b:02X}>") for b in (0x39, 0xE6, 0x98)}
    ids = [byte[0x39], byte[0xE6], byte[0x98], spm.token_to_id("a")]
    detok = IncrementalDetokenizer(spm)
    assert [detok.push(i) for i in ids] == ["9", "", "", "\ufffd\ufffda"]
    assert detok.finish() == ""
    assert detok.push(spm.token_to_id("▁a")) == " a"  # and it keeps streaming afterwards
    held = IncrementalDetokenizer(spm)
    assert [held.push(byte[0xE6]), held.finish(), held.push(spm.token_to_id("a"))] == ["", "\ufffd", "a"]
    after_half = IncrementalDetokenizer(spm, prompt_ids=[spm.token_to_id("▁hello"), byte[0xE6]])
    assert after_half.push(spm.token_to_id("▁a")) == " a"  # the prompt's text is never emitted


# --- the tokenizer cache -------------------------------------------------------------------------
def test_a_large_vocabularys_tokenizer_is_cached_by_file_identity(q4_1_file, tmp_path, monkeypatch):
    from fastdecode.loading.tokenizer import cache

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "MIN_CACHED_VOCABULARY", 0)  # the tiny test vocabulary counts as large
    built = []
    real_build = from_gguf._byte_level_bpe
    monkeypatch.setattr(from_gguf, "_byte_level_bpe", lambda *args: built.append(1) or real_build(*args))
    fields = GGUFFile(q4_1_file).metadata

    def load() -> Tokenizer:
        return Tokenizer.from_gguf_fields(fields, path=q4_1_file)

    first, second = load(), load()
    assert len(built) == 1 and cache.cache_file(q4_1_file).is_file()
    assert second.backend.to_str() == first.backend.to_str() == Tokenizer.from_gguf_fields(fields).backend.to_str()
    assert len(built) == 2  # no path: no cache
    text = "in the sea, a 'résumé' <|im_start|>"
    assert second.encode(text) == first.encode(text) and second.eos_token_ids == first.eos_token_ids

    stat = q4_1_file.stat()
    os.utime(q4_1_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed: a miss
    load()
    assert len(built) == 3
    cache.cache_file(q4_1_file).write_text("{ damaged")  # an unreadable entry: built and written again
    assert load().backend.to_str() == first.backend.to_str() and len(built) == 4
    load()
    assert len(built) == 4

    monkeypatch.setenv("FASTDECODE_CACHE", "off")
    assert cache.cache_file(q4_1_file) is None
    load()
    assert len(built) == 5


def test_the_garbage_collector_is_paused_while_a_model_loads_then_as_it_was(monkeypatch):
    import gc

    import fastdecode.api

    seen = []
    monkeypatch.setattr(fastdecode.api, "load", lambda *args, **kwargs: seen.append(gc.isenabled()) or "loaded")
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            assert fastdecode.load("x") == "loaded" and gc.isenabled() is enabled
        monkeypatch.setattr(fastdecode.api, "load", lambda *args, **kwargs: 1 / 0)
        gc.enable()
        with pytest.raises(ZeroDivisionError):
            fastdecode.load("x")
        assert gc.isenabled()  # restored when the load fails too
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]
