"""Long-form windows: what the encoder is fed at the end of a file, and how many searches a window
costs (the temperature fallback re-decodes a window up to 5 more times, each with 5 sampled rows)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from test_whisper_real import speak, tiny_en  # noqa: F401 - tiny_en: a fixture

from fastdecode.speech.features import WINDOW_SAMPLES, log_mel, long_form_window_features, window_features
from fastdecode.speech.requests import Encode, Search
from fastdecode.speech.search import WindowResult
from fastdecode.speech.transcribe import TranscribeOptions, Transcriber


def test_a_partial_window_is_padded_with_zero_features_not_with_silence():
    torch.manual_seed(0)
    samples = torch.randn(16000 * 7 + 123) * 0.1  # 7 s and a bit: 700 frames
    got = long_form_window_features(samples, 80)
    assert got.shape == (80, 3000)
    assert torch.equal(got[:, 700:], torch.zeros(80, 2300))
    expected = log_mel(torch.nn.functional.pad(samples, (0, 160)), 80)[:, :700]
    torch.testing.assert_close(got[:, :700], expected, atol=0, rtol=0)
    assert window_features(samples, 80)[:, 702:].max() < -0.5  # the floor that it replaces


def test_partial_window_matches_faster_whispers_features():
    faster_whisper = pytest.importorskip("faster_whisper")
    from faster_whisper.audio import pad_or_trim

    torch.manual_seed(1)
    n = 16000 * 9 + 77
    samples = torch.randn(n) * 0.1 * torch.sin(torch.arange(n) / 40.0)
    full = faster_whisper.feature_extractor.FeatureExtractor(feature_size=80)(samples.numpy())
    expected = pad_or_trim(full[:, : full.shape[-1] - 1])  # its content frames, then zeros
    np.testing.assert_allclose(long_form_window_features(samples, 80).numpy(), expected, atol=1e-4, rtol=0)


def test_a_full_window_is_unchanged_but_for_its_last_frame():
    torch.manual_seed(2)
    samples = torch.randn(WINDOW_SAMPLES) * 0.1
    torch.testing.assert_close(long_form_window_features(samples)[:, :-1], window_features(samples)[:, :-1])


def test_every_window_the_transcription_encodes_is_long_form_padded():
    """35 s of audio: a full window, then (seeking to its end) 5 s padded with zero features."""
    vocabulary = SimpleNamespace(decode=lambda ids: " w", eot=999, timestamp_begin=1000, multilingual=False,
                                 encode=lambda text: [1], sot_prev=2, sot_sequence=lambda *args: [3, 4])
    checkpoint = SimpleNamespace(model=None, vocabulary=vocabulary, suppress_tokens=[], suppress_at_begin=[],
                                 config=SimpleNamespace(max_target_positions=448, num_mel_bins=80))
    steps = Transcriber(checkpoint).steps(torch.randn(16000 * 35) * 0.1, TranscribeOptions(language="en"))
    encoded, request = [], next(steps)
    with pytest.raises(StopIteration):
        while True:
            if isinstance(request, Encode):
                encoded.append(request.features)
                request = steps.send("sources")
            else:
                assert isinstance(request, Search) and request.options.temperature == 0.0
                request = steps.send(WindowResult([5, 6], -0.2))  # no timestamps: the whole window is consumed
    assert len(encoded) == 2 and encoded[0].abs().sum(0).min() > 0
    assert torch.equal(encoded[1][:, 500:], torch.zeros(80, 2500))


def two_minutes_of_speech(tmp_path) -> str:
    """benchmarks/whisper_speed.py's recording (made once, cached in the temporary folder)."""
    speak(tmp_path, "en-us", 130, "check")  # skips when espeak-ng is missing
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.syspath_prepend(str(benchmarks))
    try:
        import whisper_speed
    finally:
        monkeypatch.undo()
    return str(whisper_speed.recording(2))


@pytest.mark.slow
def test_two_minutes_greedy_decode_each_window_once(tiny_en, tmp_path, monkeypatch):  # noqa: F811
    """The recording whose last window (8.5 s under 223 tokens of previous text) looped on silence
    padding: now every window is encoded once and searched once, at temperature 0, as faster-whisper
    does it."""
    from fastdecode import load_speech
    from fastdecode.speech import batching

    torch.set_num_threads(2)
    speech = load_speech(tiny_en)
    calls = {"encode": 0, "search": []}
    encode, search_request = batching.encode_windows, batching.search_request

    def counting_encode(model, features):
        calls["encode"] += features.shape[0]
        return encode(model, features)

    def counting_search(vocabulary, request, vocab_size, device):
        calls["search"].append(request.options.temperature)
        return search_request(vocabulary, request, vocab_size, device)

    monkeypatch.setattr(batching, "encode_windows", counting_encode)
    monkeypatch.setattr(batching, "search_request", counting_search)
    result = speech.transcribe(two_minutes_of_speech(tmp_path), language="en", beam_size=1)
    windows = len({s.seek for s in result.segments})
    assert calls["search"] == [0.0] * calls["encode"] and calls["encode"] in (windows, windows + 1)
    assert "help with the project" in result.text and ("pharmacy" in result.text or "farmer" in result.text)
