"""GGUF loading against oracles: tiny random HF models written to .gguf with the official writer.

Every file is written with ``gguf.GGUFWriter`` the way llama.cpp's ``convert_hf_to_gguf.py``
writes it: the same metadata keys, llama.cpp tensor names, 2-D weights quantized with
``gguf.quants.quantize`` (1-D norms and biases stay F32), GPT-2 Conv1D weights transposed to
[out, in], and for ``llama`` (not ``qwen2``) the Q/K rows permuted for interleaved RoPE. The
oracle is the HF model itself (F32), or a copy of it whose weights went through the same
quantize/dequantize round trip (quantization works on rows, and the Q/K permutation moves whole
rows, so round-tripping in HF layout gives exactly the weights the file holds). Independent
cross-checks: ``gguf.GGUFReader`` for the parser and ``transformers``' own GGUF loader.
"""

from __future__ import annotations

import copy
import os
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.errors import CheckpointError, TokenizerError, UnsupportedModelError  # noqa: E402
from fastdecode.generation.decode import left_pad  # noqa: E402
from fastdecode.generation.step import CachedEngine  # noqa: E402
from fastdecode.loading.gguf_file import GGUFFile  # noqa: E402
from fastdecode.models import llama as llama_family  # noqa: E402
from tiny_models import _rope  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ATOL = 1e-4


@pytest.fixture(autouse=True)
def exact_quantized_products(monkeypatch):
    """These tests check the GGUF conversion (layouts, permutations, block decoding) against transformers
    at 1e-4, so every product takes the exact dequantize-then-GEMM path; the decode kernel's int8
    activation rounding is bounded separately (test_quantized.py)."""
    from fastdecode.layers import quantized

    monkeypatch.setattr(quantized, "KERNEL_MAX_ROWS", 0)
NEW_TOKENS = 16


# --- a tiny byte-level BPE vocabulary (GPT-2 style) ------------------------------------------
def _gpt2_byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order: the 256 base tokens of a byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = _gpt2_byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS
TOKEN_TYPES = [1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
VOCAB = len(TOKENS)  # 267
EOT = TOKENS.index("<|endoftext|>")

FILE_TYPES = {QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.BF16: LlamaFileType.MOSTLY_BF16,
              QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q4_0: LlamaFileType.MOSTLY_Q4_0,
              QT.Q4_1: LlamaFileType.MOSTLY_Q4_1}
GGUF_ARCH = {"llama-gqa": "llama", "llama-mqa": "llama", "llama-tied": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}


# --- tiny random HF models ---------------------------------------------------------------------
@lru_cache(maxsize=None)
def hf_model(kind: str, seed: int = 0):
    """Seeded eval-mode HF model. Weights are re-drawn at std 0.1 (norm gains ~1, biases non-zero):
    HF's default init (std 0.02, zero biases) leaves attention nearly uniform, so a wrong Q/K row
    order would barely move the logits."""
    tf = transformers
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                  bos_token_id=EOT, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if kind == "llama-gqa":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | {"num_key_value_heads": 2}, **_rope(50000.0)))
    elif kind == "llama-mqa":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | {"num_key_value_heads": 1}, **_rope()))
    elif kind == "llama-tied":
        config = tf.LlamaConfig(**common | {"num_key_value_heads": 2, "tie_word_embeddings": True}, **_rope())
        model = tf.LlamaForCausalLM(config)
    elif kind == "qwen2":  # q/k/v biases; llama.cpp does not permute qwen2's Q/K
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common | {"num_key_value_heads": 2}, **_rope(1e6)))
    elif kind == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                               layer_norm_epsilon=1e-5, bos_token_id=EOT, eos_token_id=EOT,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(config)
    else:
        raise ValueError(kind)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters are listed once
            noise = torch.randn(param.shape, generator=generator)
            is_norm_gain = param.ndim == 1 and name.endswith("weight")
            param.copy_(1 + 0.1 * noise if is_norm_gain else 0.1 * noise)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _is_conv1d(name: str) -> bool:
    return name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


def hf_reference(kind: str, qtype: QT):
    """The HF model with every weight the GGUF file quantizes replaced by its dequantized value."""
    model = hf_model(kind)
    if qtype == QT.F32:
        return model
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.ndim != 2 or name.endswith("wpe.weight"):  # stored F32 (see _write)
                continue
            rows = param.numpy().T if _is_conv1d(name) else param.numpy()  # GGUF rows: [out, in]
            rows = dequantize(quantize(np.ascontiguousarray(rows), qtype), qtype)
            param.copy_(torch.from_numpy(rows.T if _is_conv1d(name) else rows))
    return reference


# --- HF -> GGUF, as convert_hf_to_gguf.py does it ----------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: Q/K rows from half-split to interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(kind: str) -> dict[str, np.ndarray]:
    """llama.cpp tensor name -> float32 array (numpy order, i.e. HF's [out, in] for linears)."""
    model = hf_model(kind)
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {}
    if kind == "gpt2":
        out["token_embd.weight"] = sd["transformer.wte.weight"]
        out["position_embd.weight"] = sd["transformer.wpe.weight"]
        parts = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
                 "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
        for i in range(cfg.n_layer):
            for hf_part, part in parts.items():
                for kind_ in ("weight", "bias"):
                    value = sd[f"transformer.h.{i}.{hf_part}.{kind_}"]
                    out[f"blk.{i}.{part}.{kind_}"] = value.T.copy() if value.ndim == 2 else value
        out["output_norm.weight"] = sd["transformer.ln_f.weight"]
        out["output_norm.bias"] = sd["transformer.ln_f.bias"]
        return out  # tied: the converter writes no output.weight for GPT-2

    permute = GGUF_ARCH[kind] == "llama"
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    out["token_embd.weight"] = sd["model.embed_tokens.weight"]
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf_part, part in parts.items():
            for kind_ in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_part}.{kind_}"
                if key not in sd:
                    continue
                value = sd[key]
                if permute and part in ("attn_q", "attn_k"):
                    value = llama_cpp_permute(value, heads if part == "attn_q" else kv_heads)
                out[f"blk.{i}.{part}.{kind_}"] = value
    out["output_norm.weight"] = sd["model.norm.weight"]
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    return out


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None)  # transformers 5.x; 4.x: rope_theta
    return parameters["rope_theta"] if parameters else config.rope_theta


def write_gguf(path: Path, kind: str, qtype: QT = QT.F32, *, arch: str | None = None,
               tensors: dict[str, np.ndarray] | None = None, pre: str | None = "default") -> Path:
    """Write ``kind`` as a GGUF file; ``arch`` / ``tensors`` / ``pre`` override for error cases."""
    model = hf_model(kind)
    cfg = model.config
    arch = arch or GGUF_ARCH[kind]
    tensors = gguf_tensors(kind) if tensors is None else tensors
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny random {kind}")
    if kind == "gpt2":  # GPT2Model.set_gguf_parameters
        writer.add_block_count(cfg.n_layer)
        writer.add_context_length(cfg.n_positions)
        writer.add_embedding_length(cfg.n_embd)
        writer.add_feed_forward_length(4 * cfg.n_embd)
        writer.add_head_count(cfg.n_head)
        writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:  # TextModel / LlamaModel.set_gguf_parameters
        head_dim = cfg.hidden_size // cfg.num_attention_heads
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_rope_freq_base(_rope_theta(cfg))
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if arch == "llama":
            writer.add_vocab_size(cfg.vocab_size)
            writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(FILE_TYPES[qtype])
    # SpecialVocab / get_vocab_base: byte-level BPE vocabulary
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOT)
    writer.add_eos_token_id(EOT)
    for name, array in tensors.items():
        # prepare_tensors: 1-D tensors, norms and position embeddings stay F32
        keep_f32 = array.ndim != 2 or name.endswith("_norm.weight") or name.startswith("position_embd")
        if array.dtype != np.float32:  # error cases: written as given (e.g. int32 -> ggml I32)
            writer.add_tensor(name, array)
        elif keep_f32 or qtype == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(array, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
            cache[kind, qtype] = fastdecode.load(str(gguf_file(kind, qtype)))
        return cache[kind, qtype]

    return get


# --- helpers -----------------------------------------------------------------------------------
def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (length,), generator=generator).tolist()


def _our_logits(gen, ids: list[int]) -> torch.Tensor:
    """Prefill logits at every position [T, V] through the cached engine."""
    model = gen.model
    engine = CachedEngine(model, 1, len(ids))
    tokens, valid, positions = left_pad([ids], model.device)
    with torch.inference_mode():
        return engine.prefill(tokens, valid, positions, all_logits=True)[0]


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


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mqa", "llama-tied", "qwen2", "gpt2"])
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
    assert cfg.rope_theta == _rope_theta(hf)
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert cfg.bos_token_id == EOT and EOT in cfg.eos_token_ids


def test_qk_unpermutation_is_what_makes_llama_match(loaded, gguf_file, monkeypatch):
    """Negative control: loading the llama file without undoing the permutation visibly breaks
    parity, so the parity tests above really exercise ``gguf_to_hf_layout``."""
    monkeypatch.setattr(llama_family, "gguf_to_hf_layout", lambda canonical, weight, config: weight)
    unpermuted = fastdecode.load(str(gguf_file("llama-gqa")))
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


def _truncated_copy(source: Path, folder: Path, size: int) -> Path:
    target = folder / f"cut-{size}.gguf"
    target.write_bytes(source.read_bytes()[:size])
    return target


def test_truncated_inside_tensor_data_names_the_file(gguf_file, tmp_path):
    source = gguf_file("llama-gqa", QT.Q4_0)
    start, end = _data_region(source)
    for size in [start, start + 1, (start + end) // 2, end - 1]:
        path = _truncated_copy(source, tmp_path, size)
        with pytest.raises(CheckpointError, match="truncated") as info:
            fastdecode.load(str(path))
        assert str(path) in str(info.value)


def test_truncated_anywhere_in_the_header_is_a_checkpoint_error(gguf_file, tmp_path):
    source = gguf_file("llama-gqa")
    start, _ = _data_region(source)
    sizes = sorted({0, 1, 3, 4, 8, 23, 24, 25, 40, start - 1, *range(0, start, max(1, start // 60))})
    for size in sizes:
        path = _truncated_copy(source, tmp_path, size)
        with pytest.raises(CheckpointError) as info:
            GGUFFile(path)
        assert str(path) in str(info.value), size
    path = _truncated_copy(source, tmp_path, start // 2)
    with pytest.raises(CheckpointError) as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("header,match", [(b"GGML", "not a GGUF file"), (b"GGUF\x01\x00\x00\x00", "version"),
                                          (b"GGUF\x04\x00\x00\x00", "version")],
                         ids=["bad-magic", "version-1", "version-4"])
def test_bad_magic_or_version(header, match, gguf_file, tmp_path):
    data = bytearray(gguf_file("llama-gqa").read_bytes())
    data[: len(header)] = header
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=match) as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)


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
    path = write_gguf(tmp_path / "mismatch.gguf", "llama-gqa", tensors=tensors)
    with pytest.raises(CheckpointError) as info:
        fastdecode.load(str(path))
    message = str(info.value)
    assert "blk.1.ffn_gate.weight" in message and "blk.0.attn_extra.weight" in message
    assert "missing" in message and "unexpected" in message and str(path) in message


def test_tensor_of_a_type_that_cannot_be_decoded(tmp_path):
    tensors = gguf_tensors("llama-gqa")
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"].astype(np.int32)  # ggml I32
    path = write_gguf(tmp_path / "i32.gguf", "llama-gqa", tensors=tensors)
    with pytest.raises(CheckpointError, match=r"blk\.0\.ffn_up\.weight.*I32") as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)


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
    with pytest.raises(CheckpointError, match=key.replace(".", r"\.")) as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)


def test_unsupported_pre_tokenizer_is_a_tokenizer_error_naming_the_file(tmp_path):
    path = write_gguf(tmp_path / "pre.gguf", "llama-gqa", pre="no-such-split")
    with pytest.raises(TokenizerError, match="no-such-split") as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)


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


# --- 4: the parser against gguf.GGUFReader ---------------------------------------------------------
METADATA = [  # (key, value, value type, array item type)
    ("test.u8", 250, GGUFValueType.UINT8, None),
    ("test.i8", -120, GGUFValueType.INT8, None),
    ("test.u16", 65000, GGUFValueType.UINT16, None),
    ("test.i16", -32000, GGUFValueType.INT16, None),
    ("test.u32", 4_000_000_000, GGUFValueType.UINT32, None),
    ("test.i32", -2_000_000_000, GGUFValueType.INT32, None),
    ("test.u64", 2**64 - 3, GGUFValueType.UINT64, None),
    ("test.i64", -(2**62) - 7, GGUFValueType.INT64, None),
    ("test.f32", 0.1, GGUFValueType.FLOAT32, None),
    ("test.f64", 0.1, GGUFValueType.FLOAT64, None),
    ("test.true", True, GGUFValueType.BOOL, None),
    ("test.false", False, GGUFValueType.BOOL, None),
    ("test.string", "héllo wörld ✓ 🤗", GGUFValueType.STRING, None),
    ("test.u8s", [0, 7, 255], GGUFValueType.ARRAY, GGUFValueType.UINT8),
    ("test.i16s", [-5, 0, 5], GGUFValueType.ARRAY, GGUFValueType.INT16),
    ("test.i32s", [1, -2, 2**31 - 1], GGUFValueType.ARRAY, GGUFValueType.INT32),
    ("test.u64s", [0, 2**64 - 1], GGUFValueType.ARRAY, GGUFValueType.UINT64),
    ("test.i64s", [-(2**63), 2**63 - 1], GGUFValueType.ARRAY, GGUFValueType.INT64),
    ("test.f32s", [0.1, -2.5, 1e30], GGUFValueType.ARRAY, GGUFValueType.FLOAT32),
    ("test.f64s", [0.1, -2.5, 1e300], GGUFValueType.ARRAY, GGUFValueType.FLOAT64),
    ("test.bools", [True, False, True], GGUFValueType.ARRAY, GGUFValueType.BOOL),
    ("test.strings", ["a", "", "ünï", "<|im_end|>"], GGUFValueType.ARRAY, GGUFValueType.STRING),
]
# (name, type, [rows, columns]); K-quants cannot be quantized by gguf-py: random blocks instead.
TENSORS = [("t.f32", QT.F32, [3, 64]), ("t.f16", QT.F16, [3, 64]), ("t.bf16", QT.BF16, [3, 64]),
           ("t.q8_0", QT.Q8_0, [5, 96]), ("t.q4_0", QT.Q4_0, [5, 64]), ("t.q4_1", QT.Q4_1, [2, 32]),
           ("t.q5_0", QT.Q5_0, [3, 64]), ("t.q5_1", QT.Q5_1, [3, 64]),
           ("t.q4_k", QT.Q4_K, [2, 256]), ("t.q6_k", QT.Q6_K, [3, 512])]


@pytest.fixture(scope="module")
def everything_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("meta") / "everything.gguf"
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)  # general.alignment: data is not at the default 32
    for key, value, vtype, sub_type in METADATA:
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, qtype, shape in TENSORS:
        if qtype in (QT.Q4_K, QT.Q6_K):
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(rng.standard_normal(shape, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.add_tensor("t.f32_1d", rng.standard_normal(7, dtype=np.float32))
    writer.add_tensor("t.f32_3d", rng.standard_normal((2, 3, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_metadata_equals_gguf_reader(everything_file):
    reader = GGUFReader(everything_file)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    ours = GGUFFile(everything_file).metadata
    assert ours == expected
    assert ours["general.alignment"] == 64 and ours["general.architecture"] == "llama"
    for key, value, vtype, _ in METADATA:  # and the values written, exactly (f32 rounded)
        if vtype == GGUFValueType.FLOAT32:
            assert ours[key] == float(np.float32(value)), key
        elif key == "test.f32s":
            assert ours[key] == np.asarray(value, np.float32).tolist()
        else:
            assert ours[key] == value and type(ours[key]) is type(value), key


def test_nested_array_metadata(tmp_path):
    """Arrays of arrays (GGUFReader flattens them, so compare with the written value)."""
    path = tmp_path / "nested.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_key_value("test.nested", [[1, 2], [3], ["x", "y"]], GGUFValueType.ARRAY)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFile(path).metadata["test.nested"] == [[1, 2], [3], ["x", "y"]]


def test_tensor_table_and_dequantized_values_equal_gguf_reader(everything_file):
    ours = GGUFFile(everything_file)
    reader_tensors = {t.name: t for t in GGUFReader(everything_file).tensors}
    assert set(ours.tensors) == set(reader_tensors)
    for name, theirs in reader_tensors.items():
        info = ours.tensors[name]
        assert info.ggml_type == theirs.tensor_type
        assert info.shape == tuple(int(d) for d in reversed(theirs.shape.tolist())), name
        assert info.offset == theirs.data_offset and info.nbytes == theirs.n_bytes, name
        assert info.offset % 64 == 0, name
        expected = dequantize(theirs.data, theirs.tensor_type).reshape(info.shape)
        values = ours.dequantized(name)
        assert values.dtype == np.float32 and values.shape == info.shape, name
        np.testing.assert_array_equal(values, expected, err_msg=name)  # NaN == NaN (random K blocks)


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
    path = write_gguf(tmp_path / "bad-meta.gguf", "llama-gqa")
    with pytest.raises(CheckpointError, match=match) as info:
        fastdecode.load(str(path))
    assert str(path) in str(info.value)
