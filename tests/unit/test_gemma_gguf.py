"""Gemma 3 and Gemma 2 GGUF conversion, proven on tiny files written the way llama.cpp's converter
writes them.

``convert_hf_to_gguf.py`` (Gemma3Model, Gemma2Model) stores every norm weight as 1 + w and keeps
Q/K rows in HF order (llama.cpp rotates Gemma in the NeoX, half-split layout); Gemma 2 files add
both soft-caps and the window, and leave the 2-layer pattern and the RoPE base to llama.cpp's
defaults. The files below are written that way with ``gguf.GGUFWriter``; the oracles are the HF
model each came from and transformers' own GGUF loader reading the same file (where it reads
the architecture). Neither llama.cpp nor transformers read the query scale from a GGUF file, both
assume query_pre_attn_scalar = head_dim (256 for Gemma 3 as in every size; 32 for the tiny Gemma 2).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

import fastdecode  # noqa: E402
from fastdecode.loading.gguf_file import GGUFFile  # noqa: E402
from tiny_models import build_gemma2, build_gemma3, prefill_logits  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ATOL = 1e-4
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
TOKENS = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "▁a", "▁b", "ab", "▁ab"]
TOKEN_TYPES = [3] * len(SPECIALS) + [6] * 256 + [1] * 5  # 3 control, 6 byte, 1 normal
VOCAB = len(TOKENS)
PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def hf_model(request):
    """Gemma 3: six layers (five sliding, one full: transformers' default pattern, which a GGUF file
    implies). Gemma 2: four layers alternating (its default pattern), both caps, head_dim 32."""
    if request.param == "gemma2":
        return build_gemma2(seed=1, vocab_size=VOCAB, query_pre_attn_scalar=32, layer_types=None, bos_token_id=2,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return build_gemma3(seed=1, vocab_size=VOCAB, num_hidden_layers=6, num_attention_heads=2, head_dim=256,
                        query_pre_attn_scalar=256, final_logit_softcapping=None, layer_types=None,
                        bos_token_id=2, pad_token_id=0)


def _write(path, model) -> None:
    cfg = model.config
    arch = cfg.model_type.removesuffix("_text")  # gemma3_text -> gemma3
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    if arch == "gemma3":
        writer.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    else:  # Gemma2Model.set_gguf_parameters: the caps; no RoPE base (llama.cpp's default 10,000)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    state = {name: tensor.detach().numpy() for name, tensor in model.state_dict().items()}
    tensors = {"token_embd.weight": state["model.embed_tokens.weight"],
               "output_norm.weight": state["model.norm.weight"] + 1}
    for i in range(cfg.num_hidden_layers):
        for hf_part, part in PARTS.items():
            if f"model.layers.{i}.{hf_part}.weight" not in state:  # Gemma 2: no q/k norms
                continue
            value = state[f"model.layers.{i}.{hf_part}.weight"]
            tensors[f"blk.{i}.{part}.weight"] = value + 1 if part.endswith("norm") else value  # llama.cpp: 1 + w
    for name, value in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_path(hf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma") / f"tiny-{hf_model.config.model_type}.gguf"
    _write(path, hf_model)
    return path


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_file_stores_norms_plus_one_and_config_round_trips(hf_model, gguf_path):
    stored = GGUFFile(gguf_path).dequantized("blk.0.post_attention_norm.weight")
    norm = hf_model.model.layers[0].post_attention_layernorm.weight.detach().numpy()
    np.testing.assert_array_equal(stored, norm + 1)
    cfg = fastdecode.load(str(gguf_path)).config
    assert cfg.layer_types == hf_model.config.layer_types
    assert cfg.tie_word_embeddings and cfg.sliding_window == 8
    if cfg.family == "gemma2":
        assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1e4, 1e4, 32**-0.5)
        assert (cfg.attention_softcapping, cfg.final_logit_softcapping) == (5.0, 3.0)
        return
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.attention_scale) == (1e6, 1e4, 256**-0.5)


def test_gguf_logits_match_the_hf_model_and_transformers_reading_the_same_file(hf_model, gguf_path):
    ids = _ids(30, 1)  # past the window of 8
    ours = prefill_logits(fastdecode.load(str(gguf_path)), ids)
    torch.testing.assert_close(ours, _logits(hf_model, ids), atol=ATOL, rtol=0)
    if hf_model.config.model_type == "gemma2":
        return  # transformers' GGUF reader takes Gemma 2's caps and query scale from its defaults, not the file
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    torch.testing.assert_close(ours, _logits(theirs.eval(), ids), atol=ATOL, rtol=0)


def test_gguf_greedy_equals_hf(hf_model, gguf_path):
    prompt = _ids(12, 2)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 12, dtype=torch.long),
                                max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert fastdecode.load(str(gguf_path)).generate_ids([prompt], max_new_tokens=24)[0] == out[0, 12:].tolist()
