"""Tiny seeded random `transformers` models of every decoder-only family, for parity tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 160


def _shared_sizes(**overrides):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    base.update(overrides)
    return base


def _rope(theta=10000.0, scaling=None):
    """rope settings in the form this transformers version expects (4.x or 5.x)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    return {"rope_theta": theta, "rope_scaling": scaling}


def build(kind: str, seed: int = 0, **overrides):
    """Return an eval-mode HF model of the given kind with seeded random weights; ``overrides`` change
    the sizes shared by the Llama-family kinds (e.g. ``intermediate_size``)."""
    import transformers as tf

    def _common(**settings):
        return _shared_sizes(**{**settings, **overrides})

    torch.manual_seed(seed)
    if kind == "llama-mha":
        config = tf.LlamaConfig(**_common(), **_rope())
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama-gqa":
        config = tf.LlamaConfig(**_common(num_key_value_heads=2, tie_word_embeddings=True), **_rope(50000.0))
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama-mqa":
        config = tf.LlamaConfig(**_common(num_key_value_heads=1, attention_bias=True, mlp_bias=True), **_rope())
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama-rope-linear":
        config = tf.LlamaConfig(**_common(num_key_value_heads=2), **_rope(scaling={"rope_type": "linear", "factor": 4.0}))
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama-rope-llama3":
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        config = tf.LlamaConfig(**_common(num_key_value_heads=2), **_rope(500000.0, scaling))
        model = tf.LlamaForCausalLM(config)
    elif kind == "llama-rope-yarn":
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        config = tf.LlamaConfig(**_common(num_key_value_heads=2), **_rope(scaling=scaling))
        model = tf.LlamaForCausalLM(config)
    elif kind == "mistral":
        config = tf.MistralConfig(**_common(num_key_value_heads=2, sliding_window=8, head_dim=16), **_rope())
        model = tf.MistralForCausalLM(config)
    elif kind == "qwen2":
        config = tf.Qwen2Config(**_common(num_key_value_heads=2, tie_word_embeddings=True), **_rope(1000000.0))
        model = tf.Qwen2ForCausalLM(config)
    elif kind == "qwen2-swa":  # per-layer windows: layer 0 full, layer 1 sliding
        config = tf.Qwen2Config(**_common(num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                                          max_window_layers=1), **_rope(1000000.0))
        model = tf.Qwen2ForCausalLM(config)
    elif kind == "gemma3":
        return build_gemma3(seed)
    elif kind == "bloom":
        return build_bloom(seed)
    elif kind == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                               bos_token_id=1, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(config)
    else:
        raise ValueError(kind)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


DECODER_KINDS = ["llama-mha", "llama-gqa", "llama-mqa", "llama-rope-linear", "llama-rope-llama3", "llama-rope-yarn",
                 "mistral", "qwen2", "qwen2-swa", "gemma3", "gpt2", "bloom"]
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def build_gemma3(seed: int = 0, **overrides):
    """Tiny Gemma 3: multi-query, sliding layers (window 8) around a full one, distinct RoPE bases,
    a query scale that is not head_dim, logit softcapping, and non-zero (1 + w) norm weights
    (transformers initializes them to 0, which would hide a missing +1)."""
    import transformers as tf

    torch.manual_seed(seed)
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    if int(tf.__version__.split(".")[0]) >= 5:
        rope_options = {"rope_parameters": rope}
    else:
        rope_options = {"rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                   sliding_window=8, layer_types=GEMMA3_LAYER_TYPES, max_position_embeddings=256,
                   final_logit_softcapping=30.0, bos_token_id=1, eos_token_id=None, pad_token_id=0,
                   tie_word_embeddings=True, **rope_options)
    options.update(overrides)
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**options)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(0.3 * torch.randn(param.shape, generator=generator, device="cpu"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def save_word_tokenizer(folder, vocab_size: int = VOCAB, chat_template: str | None = None) -> None:
    """A word-level tokenizer of ``vocab_size`` tokens (ids 0-2 special), saved as tokenizer.json.

    Enough for text in / text out through a tiny random model; decoded words are space-joined.
    """
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(vocab_size - len(specials))]
    vocab = {token: index for index, token in enumerate(specials + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(specials)
    folder = Path(folder)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def save_tiny_folder(folder, kind: str = "llama-gqa", with_tokenizer: bool = True, **overrides) -> None:
    """Save a tiny model (safetensors + config.json) and a word tokenizer into ``folder``."""
    model = build(kind, **overrides)
    model.save_pretrained(folder)
    if with_tokenizer:
        save_word_tokenizer(folder, chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return model


def build_bloom(seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, bos_token_id=1,
                            eos_token_id=None, pad_token_id=None, **overrides)
    model = tf.BloomForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(hf, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: exactly ``new_tokens`` new token ids."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids], device=hf.device),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=hf.device),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(ids):].tolist()


def copy_folder(src, dst, **config_changes):
    """A copy of the model folder ``src`` at ``dst`` (created), with ``config_changes`` applied to its
    config.json; returns ``dst``."""
    src, dst = Path(src), Path(dst)
    dst.mkdir()
    for path in src.iterdir():
        (dst / path.name).write_bytes(path.read_bytes())
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        config.update(config_changes)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def prefill_logits(gen, ids: list[int]) -> torch.Tensor:
    """A Generator's logits [T, V] at every position of one cached prefill of ``ids``."""
    from fastdecode.generation.decode import left_pad
    from fastdecode.generation.step import CachedEngine

    engine = CachedEngine(gen.model, 1, len(ids))
    with torch.inference_mode():
        return engine.prefill(*left_pad([ids], gen.model.device), all_logits=True)[0]
