"""Randomly initialised transformers models of real sizes, shared by the benchmark scripts
(weights do not matter for speed; sizes do)."""

from __future__ import annotations


def build_bart():
    """bart-base size: 6 + 6 layers, d_model 768, 12 heads, FFN 3072, vocabulary 50265."""
    import transformers as tf

    config = tf.BartConfig(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6,
                           encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                           decoder_ffn_dim=3072, max_position_embeddings=1024)
    return tf.BartForConditionalGeneration(config)


def build_t5():
    """t5-small size: 6 + 6 layers, d_model 512, 8 heads, d_ff 2048, vocabulary 32128."""
    import transformers as tf

    config = tf.T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_decoder_layers=6,
                         num_heads=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return tf.T5ForConditionalGeneration(config)


def build_gpt2():
    """GPT-2 124M: 12 layers, d_model 768, vocabulary 50257."""
    import transformers as tf

    return tf.GPT2LMHeadModel(tf.GPT2Config())
