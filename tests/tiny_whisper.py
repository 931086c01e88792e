"""A tiny seeded random `transformers` Whisper, saved as a Hugging Face folder."""

from __future__ import annotations

import torch

MELS, FRAMES = 16, 60  # 60 feature frames -> 30 encoder positions
EOT, SOT, NO_TIMESTAMPS = 99, 100, 101  # the tiny model's special tokens (102..: timestamps)


def build(seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    config = dict(vocab_size=120, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=3,
                  encoder_attention_heads=4, decoder_attention_heads=2, encoder_ffn_dim=48, decoder_ffn_dim=56,
                  max_source_positions=FRAMES // 2, max_target_positions=40, decoder_start_token_id=100,
                  eos_token_id=99, pad_token_id=99, bos_token_id=99, suppress_tokens=[], begin_suppress_tokens=[])
    config.update(overrides)
    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(**config)).eval()
    with torch.no_grad():  # random biases everywhere a checkpoint has one (zeros at init hide layout bugs)
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def save(model, folder) -> None:
    model.save_pretrained(folder, safe_serialization=True)


def vocabulary():
    """Special tokens of the tiny model: 99 end, 100 start, 101 no-timestamps, 102.. timestamps."""
    from fastdecode.speech.vocabulary import WhisperVocabulary

    return WhisperVocabulary(tokenizer=None, vocab_size=120, eot=EOT, sot=SOT, transcribe=97, translate=96,
                             sot_prev=95, sot_lm=None, no_timestamps=NO_TIMESTAMPS, no_speech=94, languages={})


def run_arriving(engine, model, vocab, sources, windows, after_step=None) -> dict:
    """Search ``windows`` [(prompt, sot index, SearchOptions, the step it arrives at)] of the encoded
    ``sources`` in ``engine`` (speech/batching.py's ``speech_engine``), each added at its step -> {window
    index: its engine sequence}; ``after_step(engine)`` is called after every step."""
    from fastdecode.speech.batching import search_request, window_sources
    from fastdecode.speech.requests import Search

    sequences, step = {}, 0
    while len(sequences) < len(windows) or engine.has_work():
        for b, (prompt, sot, opts, arrives) in enumerate(windows):
            if arrives == step:
                request = Search(window_sources(sources, b), prompt, sot, opts)
                sequences[b] = engine.add(search_request(vocab, request, model.config.vocab_size, model.device))
        engine.step()
        if after_step is not None:
            after_step(engine)
        step += 1
    return sequences
