"""Tiny random transformers models written to .gguf the way llama.cpp's ``convert_hf_to_gguf.py``
writes them (metadata keys, tensor names, quantized 2-D weights, Q/K rows permuted for ``llama``),
with a tiny byte-level BPE vocabulary; and their HF references after the same quantization round
trip. Used by tests/unit/test_gguf_loading.py (its docstring says why each step is as it is),
test_load_path.py and test_quantized.py."""

from __future__ import annotations

import copy
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from tiny_models import _rope, build_phi3


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
GGUF_ARCH = {"llama-gqa": "llama", "llama-mqa": "llama", "llama-tied": "llama", "qwen2": "qwen2", "gpt2": "gpt2",
             "llama3": "llama", "qwen3": "qwen3", "granite": "granite", "smollm3": "smollm3", "olmo2": "olmo2",
             "phi3-longrope": "phi3", "phi3-swa": "phi3"}
PERMUTED = ("llama", "granite", "smollm3")  # archs whose converter (LlamaModel) permutes Q/K rows
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


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
    elif kind == "llama3":  # the file holds rope_freqs instead of scaling keys
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common | {"num_key_value_heads": 2}, **_rope(5e5, LLAMA3_SCALING)))
    elif kind == "qwen3":  # head_dim 24 (not 64 / 4), per-head q/k norms
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common | {"num_key_value_heads": 2, "head_dim": 24}, **_rope(1e6)))
    elif kind == "granite":
        config = tf.GraniteConfig(**common | {"num_key_value_heads": 2}, embedding_multiplier=3.0, residual_multiplier=0.4,
                                  attention_multiplier=0.09, logits_scaling=2.5, **_rope())
        model = tf.GraniteForCausalLM(config)
    elif kind == "smollm3":  # llama.cpp: every fourth layer without RoPE (layer 3)
        model = tf.SmolLM3ForCausalLM(tf.SmolLM3Config(**common | {"num_hidden_layers": 4, "num_key_value_heads": 2},
                                                       **_rope()))
    elif kind == "olmo2":
        model = tf.Olmo2ForCausalLM(tf.Olmo2Config(**common | {"num_key_value_heads": 2}, **_rope()))
    elif kind == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                               layer_norm_epsilon=1e-5, bos_token_id=EOT, eos_token_id=EOT,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(config)
    elif kind.startswith("phi3"):  # fused qkv and gate_up; LongRoPE or a sliding window (tiny_models.build_phi3)
        model = build_phi3(kind, seed, **{k: common[k] for k in ("vocab_size", "intermediate_size", "rms_norm_eps",
                                                                 "max_position_embeddings", "bos_token_id")})
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

    if GGUF_ARCH[kind] == "phi3":
        return _phi3_tensors(model, sd)
    permute = GGUF_ARCH[kind] in PERMUTED
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    out["token_embd.weight"] = sd["model.embed_tokens.weight"]
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    if kind == "olmo2":  # post-norms only
        parts |= {"post_attention_layernorm": "post_attention_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    if kind == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
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


def llama3_rope_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors: one divisor per frequency (1 for short
    wavelengths, the factor for long ones, a smooth ramp between), float32."""
    import math

    dim = cfg.hidden_size // cfg.num_attention_heads
    base, scaling = rope_theta(cfg), LLAMA3_SCALING
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    old_context, factor = scaling["original_max_position_embeddings"], scaling["factor"]
    low_wavelen, high_wavelen = old_context / scaling["low_freq_factor"], old_context / scaling["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _phi3_tensors(model, sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Phi3MiniModel's tensors: qkv_proj and gate_up_proj written fused (attn_qkv, ffn_up), rows as
    HF has them; the LongRoPE factors as the F32 tensors rope_factors_long / rope_factors_short."""
    cfg = model.config
    parts = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    rope = cfg.rope_parameters
    if rope.get("long_factor"):
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for i in range(cfg.num_hidden_layers):
        for hf_part, part in parts.items():
            out[f"blk.{i}.{part}.weight"] = sd[f"model.layers.{i}.{hf_part}.weight"]
    return out


def _phi3_metadata(writer: GGUFWriter, cfg) -> None:
    """What Phi3MiniModel.set_gguf_parameters adds: the rotary dims, the sliding window (0: none),
    the original context and, for LongRoPE, its attention factor."""
    rope = cfg.rope_parameters
    original = rope.get("original_max_position_embeddings", cfg.max_position_embeddings)
    writer.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None)  # transformers 5.x; 4.x: rope_theta
    return parameters["rope_theta"] if parameters else config.rope_theta


def write_gguf(path: Path, kind: str, qtype: QT = QT.F32, *, arch: str | None = None,
               tensors: dict[str, np.ndarray] | None = None, pre: str | None = "default",
               extra_metadata=None, qtypes: dict[str, QT] | None = None) -> Path:
    """Write ``kind`` as a GGUF file; ``arch`` / ``tensors`` / ``pre`` override for error cases;
    ``extra_metadata(writer)`` adds keys; ``qtypes``: tensors (by GGUF name) of another type than ``qtype``."""
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
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        writer.add_block_count(cfg.num_hidden_layers)
        writer.add_context_length(cfg.max_position_embeddings)
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(cfg.num_attention_heads)
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_rope_freq_base(rope_theta(cfg))
        writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        if arch in PERMUTED:
            writer.add_vocab_size(cfg.vocab_size)
            writer.add_rope_dimension_count(head_dim)
        if kind == "qwen3":  # TextModel.set_gguf_parameters: head_dim when the config sets it
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        if kind == "granite":  # GraniteModel: the multipliers renamed *_scale
            writer.add_attention_scale(cfg.attention_multiplier)
            writer.add_embedding_scale(cfg.embedding_multiplier)
            writer.add_residual_scale(cfg.residual_multiplier)
            writer.add_logit_scale(cfg.logits_scaling)
        if arch == "phi3":
            _phi3_metadata(writer, cfg)
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
        elif keep_f32 or (qtypes or {}).get(name, qtype) == QT.F32:
            writer.add_tensor(name, np.ascontiguousarray(array))
        else:
            own = (qtypes or {}).get(name, qtype)
            writer.add_tensor(name, quantize(np.ascontiguousarray(array, dtype=np.float32), own), raw_dtype=own)
    if extra_metadata is not None:
        extra_metadata(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
