"""The weight cache (loading/weight_cache.py): a GGUF's repacked and fused weights written once, mapped
by later loads; bit-identical to repacking, never used for a changed GGUF, rebuilt when damaged, and
the same pages for a second load of the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

import fastdecode
from fastdecode.errors import CheckpointError
from fastdecode.layers.fused import concat_outputs
from fastdecode.loading import gguf_file, weight_cache
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_blocks import repack
from tiny_gguf import gguf_tensors, write_gguf
from tiny_models import prefill_logits

IDS = [5, 70, 200, 33, 9, 140]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder, caching files of any size (tests' tiny models too)."""
    folder = tmp_path / "weights"
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE", str(folder))
    monkeypatch.setattr(weight_cache, "MIN_CACHED_BYTES", 0)
    return folder


def _entries(cache_dir) -> list:
    return sorted(cache_dir.glob("*.fdw"))


def _random_blocks(qtype: QT, rows: int, columns: int, seed: int) -> np.ndarray:
    """Random K-quant blocks [rows, bytes per row] (gguf-py cannot quantize K-quants) with finite scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(seed).integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    scales = (0, 2) if qtype == QT.Q4_K else (208,)  # offsets of the float16 d (and dmin) in a block
    for offset in scales:
        raw[..., offset:offset + 2] = np.array([0.01], dtype="<f2").view(np.uint8)  # [rows, blocks, 2]
    return raw.reshape(rows, -1)


def _same(a, b) -> bool:
    return a is None and b is None or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K])
def test_repacked_layouts_round_trip_as_views_of_one_mapping(cache_dir, qtype):
    N, K = 16, 512
    parts = [repack(qtype.name, _random_blocks(qtype, N, K, seed), (N, K), tile=True) for seed in range(3)]
    fused, views = concat_outputs(parts)  # Q6_K (groups of 16) stays in the rows layout, Q4_K is tiled
    rows = repack(qtype.name, _random_blocks(qtype, N, K, 7), (N, K))
    weights = {"q": views[0].t(), "k": views[1].t(), "v": views[2].t(), "table": rows, "head": rows.t()}
    where = cache_dir / "entry.fdw"
    weight_cache.save(where, {"made": "here"}, weights, {100: 200})
    loaded, ends = weight_cache.load(where, {"made": "here"})
    assert ends == {100: 200}
    for name, weight in weights.items():
        for field in ("kind", "bits", "group", "transposed", "outputs", "inputs", "dtype", "is_tiled"):
            assert getattr(loaded[name], field) == getattr(weight, field), (name, field)
        for part in ("codes", "scale", "mins"):
            assert _same(getattr(loaded[name], part), getattr(weight, part)), (name, part)
    # views stay views: the tied pair shares its codes, and the fused parts concatenate without a copy
    assert loaded["table"].codes.data_ptr() == loaded["head"].codes.data_ptr()
    refused, _ = concat_outputs([loaded[name].t() for name in ("q", "k", "v")])
    assert refused.codes.data_ptr() == loaded["q"].codes.data_ptr()
    assert _same(refused.codes, fused.codes) and _same(refused.scale, fused.scale)
    with pytest.raises(weight_cache.StaleCacheEntry, match="another file"):
        weight_cache.load(where, {"made": "elsewhere"})


# q/k/v biases fused; a tied head; LongRoPE factors the build takes out of the dict; GPT-2's transposed
# Conv1D layout and float position table; per-head q/k norms
@pytest.mark.parametrize("kind,qtype", [("qwen2", QT.Q8_0), ("llama-tied", QT.Q4_1), ("phi3-longrope", QT.Q4_0),
                                        ("gpt2", QT.Q8_0), ("qwen3", QT.Q4_1)])
def test_cached_load_gives_the_same_logits_as_repacking(tmp_path, cache_dir, monkeypatch, kind, qtype):
    path = write_gguf(tmp_path / f"{kind}.gguf", kind, qtype)
    missed = fastdecode.load(path)  # repacks, then writes the entry
    assert missed.checkpoint.weight_cache is not None and len(_entries(cache_dir)) == 1
    hit = fastdecode.load(path)
    assert hit.checkpoint.weight_cache is None  # came from the entry
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE", "off")
    plain = fastdecode.load(path)
    expected = prefill_logits(plain, IDS)
    assert torch.equal(prefill_logits(missed, IDS), expected)
    assert torch.equal(prefill_logits(hit, IDS), expected)
    assert hit.generate("the sea", max_new_tokens=6) == plain.generate("the sea", max_new_tokens=6)
    # what was one tensor under two names (a tied head's codes and its table's) is one tensor again
    def held(gen):
        return {name: getattr(w, "codes", w) for name, w in gen.checkpoint.weights.items()}

    plain_held, hit_held = held(plain), held(hit)
    shared = [(a, b) for a in plain_held for b in plain_held if a < b and plain_held[a] is plain_held[b]]
    assert all(hit_held[a] is hit_held[b] for a, b in shared), shared
    assert len({id(t) for t in hit_held.values()}) == len({id(t) for t in plain_held.values()})


def test_a_changed_gguf_is_repacked_and_a_truncated_one_refused(tmp_path, cache_dir):
    path = write_gguf(tmp_path / "m.gguf", "llama-gqa", QT.Q8_0)
    first = prefill_logits(fastdecode.load(path), IDS)
    stat = path.stat()
    tensors = {name: array * 1.5 if array.ndim == 2 else array for name, array in gguf_tensors("llama-gqa").items()}
    write_gguf(path, "llama-gqa", QT.Q8_0, tensors=tensors)  # same size, other blocks
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its old modification time
    assert path.stat().st_size == stat.st_size
    changed = fastdecode.load(path)
    assert changed.checkpoint.weight_cache is not None  # a miss: repacked
    assert not torch.equal(prefill_logits(changed, IDS), first)
    assert len(_entries(cache_dir)) == 1  # the old contents' entry was removed
    with open(path, "r+b") as handle:
        handle.truncate(stat.st_size - 100)
    with pytest.raises(CheckpointError, match="truncated"):
        fastdecode.load(path)


def _damage(entry, how: str) -> None:
    data = bytearray(entry.read_bytes())
    if how == "truncated":
        data = data[: len(data) - 4096]
    elif how == "weights overwritten":
        middle = len(data) // 2
        data[middle : middle + 1024] = b"\xaa" * 1024
    else:  # "index edited": a weight's description changed, its hash not
        start = data.index(b'{"data_bytes"')
        data[start + 2 : start + 6] = b"DATA"
    entry.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncated", "weights overwritten", "index edited"])
def test_a_damaged_entry_is_rebuilt_never_used(tmp_path, cache_dir, how):
    path = write_gguf(tmp_path / "m.gguf", "qwen2", QT.Q4_0)
    expected = prefill_logits(fastdecode.load(path), IDS)
    [entry] = _entries(cache_dir)
    _damage(entry, how)
    rebuilt = fastdecode.load(path)
    assert rebuilt.checkpoint.weight_cache is not None  # not read: repacked and written again
    assert torch.equal(prefill_logits(rebuilt, IDS), expected)
    assert fastdecode.load(path).checkpoint.weight_cache is None  # the new entry serves the next load


RSS_CHILD = textwrap.dedent("""
    import json, sys
    import fastdecode, torch

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    def run(gen):
        gen.generate("The capital of France is", max_new_tokens=2)

    first = fastdecode.load()
    run(first)
    after_first = rss_mb()
    second = fastdecode.load()
    run(second)
    print(json.dumps({"hit": second.checkpoint.weight_cache is None, "growth": rss_mb() - after_first,
                      "same": first.model.lm_head.codes.data_ptr() == second.model.lm_head.codes.data_ptr()}))
""")


def test_the_embedded_model_maps_its_entry_once_per_process(cache_dir, monkeypatch):
    """SmolLM2's Q4_1 entry (about 97 MB) built by one load here, read by a second (same logits as
    without the cache); a fresh process then loads it twice: the second load maps no new weight pages (its growth, about
    20 MB, is its tokenizer and caches; a second mapping would add the whole file: the tied table is read)."""
    missed = fastdecode.load()
    [entry] = _entries(cache_dir)
    hit = fastdecode.load()
    assert missed.checkpoint.weight_cache is not None and hit.checkpoint.weight_cache is None
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE", "off")
    expected = prefill_logits(fastdecode.load(), IDS)
    assert torch.equal(prefill_logits(hit, IDS), expected)
    del missed, hit
    env = {**os.environ, "FASTDECODE_WEIGHT_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", RSS_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hit"] and result["same"]
    assert result["growth"] < 0.5 * entry.stat().st_size / 2**20, result


def test_string_arrays_skipped_by_their_recorded_ends_read_the_same(tmp_path, monkeypatch):
    """The entry keeps where the GGUF's long string arrays end, so a later parse skips them (their
    strings are found when one is read): the same metadata and tensors; a wrong end is a CheckpointError."""
    monkeypatch.setattr(gguf_file, "LAZY_STRINGS", 100)  # the tiny vocabulary's 267 tokens count as long
    path = write_gguf(tmp_path / "m.gguf", "qwen2", QT.Q8_0)
    walked = GGUFFile(path)
    [(start, end)] = walked.string_array_ends.items()
    skipped = GGUFFile(path, {start: end})
    assert skipped.tensors == walked.tensors
    tokens = skipped.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 267 and tokens[-1] == "<|im_end|>" and tokens == walked.metadata["tokenizer.ggml.tokens"]
    with pytest.raises(CheckpointError, match="corrupt"):  # the parse goes on at a wrong place, or the read finds it
        GGUFFile(path, {start: end - 1}).metadata["tokenizer.ggml.tokens"][0]


def test_writing_an_entry_removes_abandoned_partial_files(tmp_path, cache_dir):
    cache_dir.mkdir()
    abandoned, live = cache_dir / "old.part", cache_dir / "new.part"
    abandoned.write_bytes(b"x")
    live.write_bytes(b"x")
    hour_ago = abandoned.stat().st_mtime_ns - (weight_cache.ABANDONED_SECONDS + 60) * 10**9
    os.utime(abandoned, ns=(hour_ago, hour_ago))
    fastdecode.load(write_gguf(tmp_path / "m.gguf", "qwen2", QT.Q4_0))
    assert not abandoned.exists() and live.exists() and len(_entries(cache_dir)) == 1


def test_two_code_versions_keep_their_entries_and_a_third_removes_the_older(tmp_path, cache_dir, monkeypatch):
    """Two installs (or source trees) loading one file in turn map their own entries; no repacking at every load."""
    path = write_gguf(tmp_path / "m.gguf", "llama-gqa", QT.Q8_0)

    def load_as(version: str):
        monkeypatch.setattr(weight_cache, "_code_version", lambda: version)
        return fastdecode.load(path).checkpoint.weight_cache  # None: mapped from an entry; else a miss, saved

    assert load_as("a" * 16) is not None and load_as("b" * 16) is not None
    assert load_as("a" * 16) is None and load_as("b" * 16) is None  # both entries kept, both hits
    assert len(_entries(cache_dir)) == 2
    assert load_as("c" * 16) is not None  # a third version keeps the newest other one (b's) beside its own
    assert sorted(entry.name.split("-")[1][0] for entry in _entries(cache_dir)) == ["b", "c"]
    assert load_as("b" * 16) is None and load_as("a" * 16) is not None
