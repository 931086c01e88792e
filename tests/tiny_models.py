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


def drawn_on_cpu(make, *args, **kwargs):
    """``make(*args, **kwargs)``'s model drawn on the CPU whatever torch's default device (the same weights
    on every device: the parity suite on a GPU tests the CPU suite's models), then moved to that device."""
    with torch.device("cpu"):
        model = make(*args, **kwargs)
    return model.to(torch.get_default_device())


def build(kind: str, seed: int = 0, **overrides):
    """``_build_here``'s model, drawn on the CPU (``drawn_on_cpu``)."""
    return drawn_on_cpu(_build_here, kind, seed, **overrides)


def _build_here(kind: str, seed: int = 0, **overrides):
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
    elif kind == "qwen3":  # head_dim 24, not hidden / heads = 16; untied
        config = tf.Qwen3Config(**_common(num_key_value_heads=2, head_dim=24), **_rope(1000000.0))
        model = _with_random_norms(tf.Qwen3ForCausalLM(config), seed)
    elif kind == "qwen3-tied-mqa":  # tied head, one KV head, q/k/v/o biases, sliding window on layer 1
        config = tf.Qwen3Config(**_common(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True,
                                          attention_bias=True, use_sliding_window=True, sliding_window=6,
                                          max_window_layers=1), **_rope(10000.0))
        model = _with_random_norms(tf.Qwen3ForCausalLM(config), seed)
    elif kind == "granite":  # every multiplier away from 1
        config = tf.GraniteConfig(**_common(num_key_value_heads=2), embedding_multiplier=3.0, residual_multiplier=0.4,
                                  attention_multiplier=0.09, logits_scaling=2.5, **_rope())
        model = tf.GraniteForCausalLM(config)
    elif kind == "smollm3":  # 4 layers, every fourth without RoPE (layer 3), tied, GQA
        config = tf.SmolLM3Config(**_common(num_hidden_layers=4, num_key_value_heads=2, tie_word_embeddings=True),
                                  **_rope(50000.0))
        model = tf.SmolLM3ForCausalLM(config)
    elif kind == "smollm3-nope-list":  # an explicit pattern: layers 0 and 2 without RoPE, scaled RoPE elsewhere
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}
        config = tf.SmolLM3Config(**_common(num_hidden_layers=3, num_key_value_heads=1), no_rope_layers=[0, 1, 0],
                                  **_rope(500000.0, scaling))
        model = tf.SmolLM3ForCausalLM(config)
    elif kind == "olmo2":  # q/k norms over the whole projection, post-norms only
        config = tf.Olmo2Config(**_common(num_key_value_heads=2), **_rope())
        model = _with_random_norms(tf.Olmo2ForCausalLM(config), seed)
    elif kind == "gemma3":
        return build_gemma3(seed)
    elif kind.startswith("phi3"):
        return build_phi3(kind, seed, **overrides)
    elif kind.startswith("gemma2"):
        return build_gemma2(kind, seed, **overrides)
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
                 "mistral", "qwen2", "qwen2-swa", "gemma3", "gpt2", "bloom", "qwen3", "qwen3-tied-mqa", "granite",
                 "smollm3", "smollm3-nope-list", "olmo2", "phi3-longrope", "phi3-swa",
                 "gemma2", "gemma2-mha"]


def _with_random_norms(model, seed: int):
    """Norm scales drawn around 1 (transformers initializes them to exactly 1, which would hide a
    q/k norm weight applied to the wrong channels)."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator, device="cpu"))
    return model
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


PHI3_SHORT_FACTORS, PHI3_LONG_FACTORS = [1.0, 1.3, 2.0, 3.5], [1.5, 4.0, 9.0, 20.0]


def build_phi3(kind: str, seed: int = 0, **overrides):
    """Tiny Phi-3. ``phi3-longrope``: GQA, half the head dims rotated (partial_rotary_factor 0.5),
    LongRoPE with distinct short and long factors switching at 64 tokens (max 256: the attention
    factor is sqrt(1 + ln 4 / ln 64)), tied. ``phi3-swa``: MQA, a sliding window of 8 on every
    layer, no scaling, untied. Weights re-drawn at std 0.1 so attention is far from uniform and the
    rotation (and its factors) moves the logits."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "phi3-longrope":
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                "short_factor": PHI3_SHORT_FACTORS, "long_factor": PHI3_LONG_FACTORS}
        options = dict(num_key_value_heads=2, partial_rotary_factor=0.5, original_max_position_embeddings=64,
                       tie_word_embeddings=True, rope_parameters=rope)
    elif kind == "phi3-swa":
        options = dict(num_key_value_heads=1, sliding_window=8, **_rope())
    else:
        raise ValueError(kind)
    config = tf.Phi3Config(**_shared_sizes(**{**options, **overrides}))
    model = tf.Phi3ForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(0.1 * torch.randn(param.shape, generator=generator, device="cpu"))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_gemma2(kind: str = "gemma2", seed: int = 0, **overrides):
    """Tiny Gemma 2: sliding (window 8) and full layers alternating, attention soft-capped at 5 and
    logits at 3 (low caps, so that tanh bends the scores and logits of these random weights), a
    query scale that is not head_dim, RoPE base 20,000, non-zero (1 + w) norm weights and the other
    weights re-drawn at std 0.15 (scores large enough for the cap to bend them). ``gemma2``:
    GQA (4 query heads on 2), head_dim 32, tied; ``gemma2-mha``: 4 heads of 16, untied.
    transformers' eager attention, the one implementation of it that applies the attention cap: its SDPA
    ignores it (transformers 5.17 chose SDPA on an H100, and the GPU parity suite's Gemma 2 tests failed)."""
    import transformers as tf

    torch.manual_seed(seed)
    heads = dict(num_key_value_heads=2, head_dim=32) if kind == "gemma2" else dict(
        num_key_value_heads=4, head_dim=16, tie_word_embeddings=False)
    options = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=4,
                   num_attention_heads=4, query_pre_attn_scalar=24, sliding_window=8, max_position_embeddings=256,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, bos_token_id=1, eos_token_id=None,
                   pad_token_id=0, tie_word_embeddings=True, attn_implementation="eager", **_rope(20000.0))
    options.update(heads)
    options.update(overrides)
    model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**options)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, device="cpu")
            param.copy_(0.3 * noise if name.endswith("norm.weight") else 0.15 * noise)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
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
    from engine_helpers import prompt_logits

    return prompt_logits(gen, ids)
