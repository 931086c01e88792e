"""Tiny seeded random `transformers` encoder-decoder models (BART, mBART, Marian, T5 v1.0 / v1.1)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import drawn_on_cpu

VOCAB = 160
ENCDEC_KINDS = ["bart", "mbart", "marian", "t5", "t5-gated"]


def _bart_family(**overrides):
    # Encoder and decoder deliberately differ in depth, heads and FFN width.
    base = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                decoder_attention_heads=2, encoder_ffn_dim=96, decoder_ffn_dim=112, max_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                eos_token_id=2, forced_eos_token_id=2)
    base.update(overrides)
    return base


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models run ~10-100x faster on one thread on a shared, loaded machine (no OpenMP spinning
    between ops of microseconds). Restored afterwards, so other modules keep their settings."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(kind: str, seed: int = 0):
    """``_build_here``'s model, drawn on the CPU whatever torch's default device (``drawn_on_cpu``)."""
    return drawn_on_cpu(_build_here, kind, seed)


def _build_here(kind: str, seed: int = 0):
    """An eval-mode HF model with seeded random weights; generation defaults that would change
    greedy decoding (forced BOS/EOS) are switched off so tests set them explicitly."""
    import transformers as tf

    torch.manual_seed(seed)
    if kind == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(**_bart_family(decoder_start_token_id=2)))
    elif kind == "mbart":  # pre-LN, final norms, scaled embeddings; no decoder_start_token_id (bos is used)
        model = tf.MBartForConditionalGeneration(tf.MBartConfig(**_bart_family(scale_embedding=True)))
    elif kind == "marian":  # sinusoidal positions, swish, its own start token (= pad)
        config = tf.MarianConfig(**_bart_family(pad_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1,
                                                eos_token_id=0, forced_eos_token_id=0, bos_token_id=None,
                                                scale_embedding=True, activation_function="swish"))
        model = tf.MarianMTModel(config)
    elif kind == "t5":  # v1.0: ReLU FFN, tied head with the d_model**-0.5 rescale
        # (a decoder deeper than the encoder breaks transformers' own T5 cache, hence 3 + 2)
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=96, num_layers=3, num_decoder_layers=2,
                             num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        model = tf.T5ForConditionalGeneration(config)
    elif kind == "t5-gated":  # v1.1 / flan: gated GELU, untied head, no rescale
        config = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=8, d_ff=96, num_layers=2, num_decoder_layers=2,
                             num_heads=6, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                             feed_forward_proj="gated-gelu", tie_word_embeddings=False)
        model = tf.T5ForConditionalGeneration(config)
        untie_t5_head(model)
    else:
        raise ValueError(kind)
    if hasattr(model, "final_logits_bias"):
        model.final_logits_bias.normal_(0.0, 0.1)  # zeros at init: make it matter
    model.eval()
    model.generation_config.forced_eos_token_id = None
    model.generation_config.forced_bos_token_id = None
    return model


def untie_t5_head(model) -> None:
    """transformers 5 ties T5's head to the embedding even for v1.1 configs; real flan-t5 checkpoints
    have their own head. Give it one, as loading such a checkpoint does."""
    model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, model.config.d_model) * 0.05)
    model.config.tie_word_embeddings = False
    model.all_tied_weights_keys = {k: v for k, v in model.all_tied_weights_keys.items() if k != "lm_head.weight"}


def hf_greedy(hf, sources: list[list[int]], new_tokens: int, **options) -> list[list[int]]:
    """transformers' greedy targets (without the decoder start token), a padded batch at once."""
    length = max(len(s) for s in sources)
    pad = hf.config.pad_token_id
    ids = torch.tensor([s + [pad] * (length - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in sources])
    options = {"min_new_tokens": new_tokens, **options}
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                          no_repeat_ngram_size=0, **options)
    return [row[1:].tolist() for row in out]


def save_tiny_encdec_folder(folder, kind: str = "bart", with_tokenizer: bool = True):
    """Save a tiny encoder-decoder (safetensors + config + generation config) and a word tokenizer."""
    from tiny_models import save_word_tokenizer

    model = build(kind)
    model.save_pretrained(folder)
    if with_tokenizer:
        save_word_tokenizer(folder, vocab_size=VOCAB)
    return model
