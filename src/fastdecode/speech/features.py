"""Whisper's log-mel features with torch: 16 kHz samples -> [M, frames] (10 ms frames).

As Whisper (and transformers' ``WhisperFeatureExtractor``) computes them: a 400-point STFT with a
periodic Hann window every 160 samples (centered, reflect-padded; the last frame dropped), power
spectrum, a Slaney-style mel filter bank (0-8 kHz, Slaney-normalized), log10 clamped at 1e-10,
floored 8 below its maximum, then (x + 4) / 4. Computed in float64, returned as float32.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..layers.threads import one_thread

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # one encoder window
WINDOW_FRAMES = WINDOW_SAMPLES // HOP_LENGTH  # 3000


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    return torch.where(log_region, 15.0 + torch.log(hz.clamp(min=1e-10) / 1000.0) / (math.log(6.4) / 27.0), mel)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    hz = 200.0 * mel / 3.0
    return torch.where(mel >= 15.0, 1000.0 * torch.exp((math.log(6.4) / 27.0) * (mel - 15.0)), hz)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int) -> torch.Tensor:
    """The filter bank [n_mels, N_FFT // 2 + 1] (float64)."""
    fft_freqs = torch.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1, dtype=torch.float64)  # [F]
    edges = torch.tensor([0.0, SAMPLE_RATE / 2], dtype=torch.float64)
    mel_points = torch.linspace(*_hz_to_mel(edges).tolist(), n_mels + 2, dtype=torch.float64)
    hz_points = _mel_to_hz(mel_points)  # [n_mels + 2]
    widths = hz_points.diff()  # [n_mels + 1]
    slopes = hz_points[:, None] - fft_freqs[None, :]  # [n_mels + 2, F]
    rising = -slopes[:-2] / widths[:-1, None]  # [n_mels, F]
    falling = slopes[2:] / widths[1:, None]
    filters = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return filters * (2.0 / (hz_points[2:] - hz_points[:-2]))[:, None]  # Slaney's area normalization


def log_mel(samples: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """Mono 16 kHz samples [N] -> log-mel features [n_mels, N // 160] (float32), on one torch thread: a
    30 s window is some 20 ms of work in ops of a few ms each; on two threads of a busy machine each op's
    OpenMP region waited for the other core (130 ms of CPU a window at load ~7 against 21 ms on one).
    Every value is computed alone (a frame's FFT, a product of 201 terms): the same bits on any count
    (tests/speech/test_speech_inputs.py)."""
    with one_thread():
        return _log_mel(samples, n_mels)


def _log_mel(samples: torch.Tensor, n_mels: int) -> torch.Tensor:
    audio = samples.to(torch.float64)
    window = torch.hann_window(N_FFT, dtype=torch.float64)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, center=True, pad_mode="reflect",
                      return_complex=True)  # [F, frames + 1]
    power = stft[:, :-1].abs() ** 2  # [F, frames]
    mel = mel_filters(n_mels) @ power  # [n_mels, frames]
    log_spec = mel.clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).to(torch.float32)


def window_features(samples: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """Up to 30 s of samples, zero-padded to 30 s -> one encoder window's features [n_mels, 3000]."""
    if samples.shape[0] > WINDOW_SAMPLES:
        raise ValueError(f"a window holds at most {WINDOW_SAMPLES} samples, got {samples.shape[0]}")
    padded = torch.nn.functional.pad(samples.to(torch.float32), (0, WINDOW_SAMPLES - samples.shape[0]))
    return log_mel(padded, n_mels)


def long_form_window_features(samples: torch.Tensor, n_mels: int = 80) -> torch.Tensor:
    """One long-form window as faster-whisper feeds it: the features of the samples themselves
    (followed by one hop of zeros, normalized on their own maximum), their ``len // 160`` frames,
    then 0.0 up to 3000 frames (its ``pad_or_trim`` of the features, not of the audio).

    A partial window (the end of a file) differs from ``window_features`` in its padding: there the
    frames of padded zero audio sit at the 8-decade floor (about -0.7 after scaling), here at 0.0.
    The floor, under a prompt of previous text, sent tiny.en into a repetition loop on an espeak-ng
    recording's last 8 s (223 tokens, compression ratio 15.9: three temperature-fallback searches of
    5 sampled rows, 58 of the transcription's 80 s) where 0.0 padding decodes the speech."""
    if samples.shape[0] > WINDOW_SAMPLES:
        raise ValueError(f"a window holds at most {WINDOW_SAMPLES} samples, got {samples.shape[0]}")
    frames = samples.shape[0] // HOP_LENGTH
    padded = torch.nn.functional.pad(samples.to(torch.float32), (0, max(HOP_LENGTH, N_FFT - samples.shape[0])))
    features = log_mel(padded, n_mels)[:, :frames]  # [n_mels, frames]
    return torch.nn.functional.pad(features, (0, WINDOW_FRAMES - frames))  # [n_mels, 3000]
