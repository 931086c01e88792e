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


def build_llama_block(num_kv_heads: int, layers: int = 4, hidden: int = 512, heads: int = 8, vocab: int = 4096,
                      context: int = 8192 + 64):
    """A small Llama (head dim 64) that differs only in its K/V heads: MHA, GQA or MQA."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                            num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=num_kv_heads,
                            max_position_embeddings=context, tie_word_embeddings=False)
    return tf.LlamaForCausalLM(config)


def saved_pair(build, folder):
    """(transformers model, fastdecode Generator) on the same random weights: the model is built (seed 0),
    saved to ``folder`` and loaded from there the way a user loads a checkpoint. Forced BOS/EOS tokens
    are off so that every engine does the same work."""
    import torch

    import fastdecode

    torch.manual_seed(0)
    hf = build().eval()
    hf.generation_config.forced_eos_token_id = None
    hf.generation_config.forced_bos_token_id = None
    hf.save_pretrained(folder)
    return hf, fastdecode.load(str(folder))


def random_ids(batch: int, length: int, vocab: int):
    """[batch, length] seeded token ids that avoid the first special ids and the last id."""
    import torch

    return torch.randint(3, vocab - 1, (batch, length), generator=torch.Generator().manual_seed(1))


def run_models(builders: dict, wanted: str, run_model, settings) -> list:
    """``run_model(name, build, settings, folder)`` for each builder whose name's first word (before a
    space or dash) is in the comma-separated ``wanted``, each in its own temporary folder."""
    import re
    import tempfile
    from pathlib import Path

    import torch

    results = []
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode(False):
        for index, (name, build) in enumerate(builders.items()):
            if re.split(r"[ -]", name)[0] in wanted.split(","):
                results.append(run_model(name, build, settings, Path(tmp) / str(index)))
    return results
