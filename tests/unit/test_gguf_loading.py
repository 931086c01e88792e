"""GGUF loading against oracles: tiny random HF models written to .gguf with the official writer.

Every file is written with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py``
writes it: the same metadata keys, llama.cpp tensor names, 2-D weights quantized with
``gguf.quants.quantize`` (1-D norms and biases stay F32), GPT-2 Conv1D weights transposed to
[out, in], and for ``llama`` (not ``qwen2``) the Q/K rows permuted for interleaved RoPE. The
oracle is the HF model itself (F32), or a copy of it whose weights went through the same
quantize/dequantize round trip (quantization works on rows, and the Q/K permutation moves whole
rows, so round-tripping in HF layout gives exactly the weights the file holds). Independent
cross-checks: ``gguf.GGUFReader`` for the parser (test_gguf_file.py) and ``transformers``' own GGUF
loader. The tiny models and the writer are in tests/tiny_gguf.py.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.errors import CheckpointError, TokenizerError, UnsupportedModelError  # noqa: E402
from engine_helpers import prompt_logits  # noqa: E402
from fastdecode.layers.products import KernelChoice  # noqa: E402
from fastdecode.loading.gguf_file import GGUFFile  # noqa: E402
from fastdecode.models import llama as llama_family  # noqa: E402
from tiny_gguf import (EOT, GGUF_ARCH, TOKENS, VOCAB, gguf_tensors, hf_model, hf_reference,  # noqa: E402
                       rope_theta, write_gguf)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ATOL = 1e-4


# These tests check the GGUF conversion (layouts, permutations, block decoding) against transformers
# at 1e-4, so the models they run are loaded with every quantized product on the exact path; the
# decode kernel's int8 activation rounding is bounded separately (test_quantized.py).
EXACT_PRODUCTS = KernelChoice(quantized_kernels=False)
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """(kind, qtype) -> path of the written file, each written once per module."""
    folder = tmp_path_factory.mktemp("gguf")
    written: dict[tuple[str, QT], Path] = {}

    def get(kind: str, qtype: QT = QT.F32) -> Path:
        if (kind, qtype) not in written:
            written[kind, qtype] = write_gguf(folder / f"{kind}-{qtype.name}.gguf", kind, qtype)
        return written[kind, qtype]

    return get


@pytest.fixture(scope="module")
def loaded(gguf_file):
    cache: dict[tuple[str, QT], fastdecode.Generator] = {}

    def get(kind: str, qtype: QT = QT.F32):
        if (kind, qtype) not in cache:
            cache[kind, qtype] = fastdecode.load(str(gguf_file(kind, qtype)), kernels=EXACT_PRODUCTS)
        return cache[kind, qtype]

    return get


# --- helpers -----------------------------------------------------------------------------------
def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def _our_logits(gen, ids: list[int]) -> torch.Tensor:
    """Prefill logits at every position [T, V] through the engine's forward."""
    return prompt_logits(gen, ids)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def _our_greedy(gen, ids: list[int], new_tokens: int) -> list[int]:
    return gen.generate_ids([ids], max_new_tokens=new_tokens, eos_token_id=[])[0]  # HF: no EOS


# --- 1, 2: weights, layout and config match the HF model ----------------------------------------
PARITY_CASES = [
    *[("llama-gqa", q) for q in (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)],
    ("llama-mqa", QT.F32), ("llama-mqa", QT.Q4_0),
    ("llama-tied", QT.F32), ("llama-tied", QT.Q8_0),
    ("qwen2", QT.F32), ("qwen2", QT.Q4_1),
    ("gpt2", QT.F32), ("gpt2", QT.Q8_0),
    ("phi3-longrope", QT.F32), ("phi3-longrope", QT.Q8_0), ("phi3-swa", QT.F32), ("phi3-swa", QT.Q4_0),
]


@pytest.mark.parametrize("kind,qtype", PARITY_CASES, ids=[f"{k}-{q.name}" for k, q in PARITY_CASES])
def test_logits_and_greedy_tokens_match_hf(kind, qtype, loaded):
    gen, reference = loaded(kind, qtype), hf_reference(kind, qtype)
    prompt = _prompt(13, seed=1)
    ours = _our_logits(gen, prompt)
    torch.testing.assert_close(ours, _hf_logits(reference, prompt), atol=ATOL, rtol=0)
    if qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):  # the quantized blocks really were decoded, not bypassed
        assert (ours - _hf_logits(hf_model(kind), prompt)).abs().max() > 10 * ATOL
    prompt = _prompt(5, seed=2)
    assert _our_greedy(gen, prompt, NEW_TOKENS) == _hf_greedy(reference, prompt, NEW_TOKENS)


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa", "llama-tied", "qwen2", "gpt2", "phi3-longrope", "phi3-swa"])
def test_config_from_metadata_matches_hf_config(kind, loaded):
    cfg, hf = loaded(kind).config, hf_model(kind).config
    if kind == "gpt2":
        assert (cfg.num_layers, cfg.num_heads, cfg.hidden_size, cfg.max_position_embeddings) == (2, 4, 64, 128)
        assert cfg.tie_word_embeddings and cfg.norm_eps == pytest.approx(1e-5)
        return
    assert cfg.architecture == GGUF_ARCH[kind]
    assert cfg.vocab_size == VOCAB
    assert cfg.num_heads == hf.num_attention_heads and cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == 16 and cfg.intermediate_size == 96 and cfg.num_layers == 2
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == (kind == "qwen2")
    assert cfg.rope_theta == rope_theta(hf)
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert cfg.bos_token_id == EOT and EOT in cfg.eos_token_ids
    if kind.startswith("phi3"):  # the knobs the folder's config.json gives: rotary share, window, capped context
        from fastdecode.models.phi3 import config_from_hf

        folder = config_from_hf(hf.to_dict())
        assert (cfg.partial_rotary_factor, cfg.sliding_window, cfg.max_position_embeddings) == (
            folder.partial_rotary_factor, folder.sliding_window, folder.max_position_embeddings)
        assert loaded(kind).model.rope.attention_factor == pytest.approx(
            fastdecode.from_hf(hf_model(kind)).model.rope.attention_factor, abs=1e-7)


def test_phi3_rope_factors_stay_float32_in_a_bfloat16_load(gguf_file):
    """The LongRoPE factors are values, not weights: a bfloat16 load must not round them (0.4% on a
    frequency is radians of error a few thousand positions on)."""
    path = str(gguf_file("phi3-longrope"))
    half, full = fastdecode.load(path, dtype="bfloat16").model, fastdecode.load(path).model
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.rope.inv_freq, full.rope.inv_freq, atol=0, rtol=0)
    folder = fastdecode.from_hf(hf_model("phi3-longrope")).model.rope.inv_freq  # factors from config.json
    torch.testing.assert_close(full.rope.inv_freq, folder, atol=0, rtol=1e-7)  # the file's are float32


def test_qk_unpermutation_is_what_makes_llama_match(loaded, gguf_file, monkeypatch):
    """Negative control: loading the llama file without undoing the permutation visibly breaks
    parity, so the parity tests above really exercise ``gguf_to_hf_layout``."""
    monkeypatch.setattr(llama_family, "gguf_to_hf_layout", lambda canonical, weight, config: weight)
    unpermuted = fastdecode.load(str(gguf_file("llama-gqa")), kernels=EXACT_PRODUCTS)
    prompt = _prompt(13, seed=1)
    error = (_our_logits(unpermuted, prompt) - _hf_logits(hf_model("llama-gqa"), prompt)).abs().max().item()
    assert error > 100 * ATOL


def test_tokenizer_from_metadata(loaded):
    tokenizer = loaded("llama-gqa").tokenizer
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.encode(" the", add_special_tokens=False) == [TOKENS.index("Ġthe")]
    text = "in the sea, a 'résumé' ✓\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>", add_special_tokens=False) == [TOKENS.index("<|im_start|>")]
    assert tokenizer.bos_token_id == EOT and EOT in tokenizer.eos_token_ids


def test_llama_cpp_gpt2_pre_tokenizer_name_is_understood(tmp_path):
    """convert_hf_to_gguf.py writes tokenizer.ggml.pre='gpt-2' for GPT-2."""
    gen = fastdecode.load(str(write_gguf(tmp_path / "gpt2-pre.gguf", "gpt2", pre="gpt-2")))
    assert gen.tokenizer.encode(" the sea", add_special_tokens=False) == [
        TOKENS.index("Ġthe"), TOKENS.index("Ġs"), TOKENS.index("e"), TOKENS.index("a")]


TRANSFORMERS_CASES = [("llama-gqa", QT.Q4_1), ("llama-mqa", QT.F32), ("qwen2", QT.Q8_0), ("gpt2", QT.F32)]


@pytest.mark.parametrize("kind,qtype", TRANSFORMERS_CASES, ids=[f"{k}-{q.name}" for k, q in TRANSFORMERS_CASES])
def test_transformers_loads_the_same_file_to_the_same_logits(kind, qtype, loaded, gguf_file):
    """transformers' GGUF loader (its own reverse permutation) is an independent oracle."""
    path = gguf_file(kind, qtype)
    # transformers maps gpt2.context_length to n_ctx only, and would size wpe by n_positions=1024
    overrides = {"n_positions": hf_model(kind).config.n_positions} if kind == "gpt2" else {}
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32, **overrides)
    except Exception as exc:  # noqa: BLE001 - any failure means this transformers cannot be the oracle
        pytest.skip(f"transformers cannot load this GGUF: {type(exc).__name__}: {exc}")
    theirs.eval()
    prompt = _prompt(13, seed=3)
    torch.testing.assert_close(_our_logits(loaded(kind, qtype), prompt), _hf_logits(theirs, prompt),
                               atol=ATOL, rtol=0)


# --- 3: errors -----------------------------------------------------------------------------------
def _data_region(path: Path) -> tuple[int, int]:
    """(first byte of tensor data, end of the last tensor's bytes), via gguf.GGUFReader."""
    reader = GGUFReader(path)
    start = min(t.data_offset for t in reader.tensors)
    end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    return start, end


def load_error(path: Path, error: type[Exception], match: str | None = None) -> str:
    """The message of the ``error`` (matching ``match``) that loading ``path`` raises, which names the file."""
    with pytest.raises(error, match=match) as info:
        fastdecode.load(str(path))
    message = str(info.value)
    assert str(path) in message
    return message


def _truncated_copy(source: Path, folder: Path, size: int) -> Path:
    target = folder / f"cut-{size}.gguf"
    target.write_bytes(source.read_bytes()[:size])
    return target


def test_truncated_inside_tensor_data_names_the_file(gguf_file, tmp_path):
    source = gguf_file("llama-gqa", QT.Q4_0)
    start, end = _data_region(source)
    for size in [start, start + 1, (start + end) // 2, end - 1]:
        load_error(_truncated_copy(source, tmp_path, size), CheckpointError, "truncated")


def test_truncated_anywhere_in_the_header_is_a_checkpoint_error(gguf_file, tmp_path):
    source = gguf_file("llama-gqa")
    start, _ = _data_region(source)
    sizes = sorted({0, 1, 3, 4, 8, 23, 24, 25, 40, start - 1, *range(0, start, max(1, start // 60))})
    for size in sizes:
        path = _truncated_copy(source, tmp_path, size)
        with pytest.raises(CheckpointError) as info:
            GGUFFile(path)
        assert str(path) in str(info.value), size
    load_error(_truncated_copy(source, tmp_path, start // 2), CheckpointError)


@pytest.mark.parametrize("header,match", [(b"GGML", "not a GGUF file"), (b"GGUF\x01\x00\x00\x00", "version"),
                                          (b"GGUF\x04\x00\x00\x00", "version")],
                         ids=["bad-magic", "version-1", "version-4"])
def test_bad_magic_or_version(header, match, gguf_file, tmp_path):
    data = bytearray(gguf_file("llama-gqa").read_bytes())
    data[: len(header)] = header
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    load_error(path, CheckpointError, match)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", "llama-gqa", arch="bert")
    with pytest.raises(UnsupportedModelError, match="'bert'") as info:
        fastdecode.load(str(path))
    for supported in ("llama", "qwen2", "gpt2"):
        assert supported in str(info.value)


def test_missing_and_unexpected_tensors_are_reported_together(tmp_path):
    tensors = gguf_tensors("llama-gqa")
    del tensors["blk.1.ffn_gate.weight"]
    tensors["blk.0.attn_extra.weight"] = np.zeros((64, 64), np.float32)
    message = load_error(write_gguf(tmp_path / "mismatch.gguf", "llama-gqa", tensors=tensors), CheckpointError)
    assert "blk.1.ffn_gate.weight" in message and "blk.0.attn_extra.weight" in message
    assert "missing" in message and "unexpected" in message


def test_tensor_of_a_type_that_cannot_be_decoded(tmp_path):
    tensors = gguf_tensors("llama-gqa")
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"].astype(np.int32)  # ggml I32
    load_error(write_gguf(tmp_path / "i32.gguf", "llama-gqa", tensors=tensors), CheckpointError,
               r"blk\.0\.ffn_up\.weight.*I32")


def test_tensor_of_an_unknown_ggml_type_code(gguf_file, tmp_path):
    data = gguf_file("llama-gqa").read_bytes()
    name = b"blk.0.ffn_up.weight"
    info_bytes = struct.pack("<Q", len(name)) + name + struct.pack("<I2Q", 2, 64, 96) + struct.pack("<I", QT.F32)
    assert data.count(info_bytes) == 1
    path = tmp_path / "unknown-type.gguf"
    path.write_bytes(data.replace(info_bytes, info_bytes[:-4] + struct.pack("<I", 250)))
    with pytest.raises(CheckpointError, match="ffn_up.*unknown ggml type 250"):
        fastdecode.load(str(path))


@pytest.mark.parametrize("key", ["llama.block_count", "llama.embedding_length", "llama.attention.head_count",
                                 "llama.feed_forward_length"])
def test_missing_required_metadata_is_a_checkpoint_error(key, gguf_file, tmp_path):
    data = gguf_file("llama-gqa").read_bytes()
    encoded = struct.pack("<Q", len(key)) + key.encode()  # GGUF string: u64 length, then bytes
    assert data.count(encoded) == 1
    renamed = struct.pack("<Q", len(key)) + b"x" * len(key)  # same length: the file stays valid
    path = tmp_path / "missing-key.gguf"
    path.write_bytes(data.replace(encoded, renamed))
    load_error(path, CheckpointError, key.replace(".", r"\."))


def test_unsupported_pre_tokenizer_is_a_tokenizer_error_naming_the_file(tmp_path):
    load_error(write_gguf(tmp_path / "pre.gguf", "llama-gqa", pre="no-such-split"), TokenizerError, "no-such-split")


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_that_is_not_a_power_of_two_is_rejected(alignment, tmp_path):
    """llama.cpp rejects these; reading on would place every tensor at a wrong offset (or divide by 0)."""
    path = tmp_path / "alignment.gguf"
    tensors = gguf_tensors("llama-gqa")
    writer = GGUFWriter(str(path), "llama")
    writer.add_key_value("general.alignment", alignment, GGUFValueType.UINT32)  # data still 32-aligned
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="alignment") as info:
        GGUFFile(path)
    assert str(path) in str(info.value)


# --- hardening (issue 10, case 11): config values and tensor shapes are checked before use ---------
def test_wrong_tensor_shapes_are_listed_together_before_any_matmul(tmp_path):
    tensors = gguf_tensors("llama-gqa")
    tensors["blk.0.attn_q.weight"] = np.zeros((64, 48), np.float32)
    tensors["blk.1.ffn_down.weight"] = np.zeros((64, 80), np.float32)
    path = write_gguf(tmp_path / "shapes.gguf", "llama-gqa", tensors=tensors)
    with pytest.raises(CheckpointError, match="2 weight") as info:
        fastdecode.load(str(path))
    message = str(info.value)
    assert "blk.0.attn_q.weight (expected [64, 64], found [64, 48])" in message
    assert "blk.1.ffn_down.weight (expected [64, 96], found [64, 80])" in message


def test_gpt2_shapes_are_compared_in_hf_layout(gguf_file):
    assert fastdecode.load(str(gguf_file("gpt2"))).config.family == "gpt2"  # Conv1D weights transposed: fine


@pytest.mark.parametrize("method, value, match", [
    ("add_head_count", 0, "attention.head_count must be an integer >= 1"),
    ("add_block_count", "2", "num_layers must be an integer >= 1, got '2'"),
    ("add_head_count_kv", 3, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
])
def test_bad_metadata_values_are_checkpoint_errors(method, value, match, tmp_path, monkeypatch):
    key = {"add_head_count": "llama.attention.head_count", "add_block_count": "llama.block_count",
           "add_head_count_kv": "llama.attention.head_count_kv"}[method]
    if isinstance(value, str):
        monkeypatch.setattr(GGUFWriter, method, lambda self, _: self.add_string(key, value))
    else:
        monkeypatch.setattr(GGUFWriter, method, lambda self, _: self.add_uint32(key, value))
    load_error(write_gguf(tmp_path / "bad-meta.gguf", "llama-gqa"), CheckpointError, match)
