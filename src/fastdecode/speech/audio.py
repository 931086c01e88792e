"""Audio in: any file FFmpeg decodes (WAV, FLAC, MP3, OGG, M4A, ...) through PyAV, converted to
mono 16-bit at 16 kHz as it is decoded (as openai-whisper's ffmpeg call and faster-whisper do: the
same samples, so the same features), then float32 / 32768, and yielded in chunks (a 3-hour file is never whole in
memory). Arrays and tensors are taken as 16 kHz mono samples already.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import AudioError
from .features import SAMPLE_RATE

AudioInput = str | Path | bytes | io.IOBase | np.ndarray | torch.Tensor


def stream_samples(audio: AudioInput) -> Iterator[torch.Tensor]:
    """Mono 16 kHz float32 samples, chunk by chunk ([n] each)."""
    if isinstance(audio, (np.ndarray, torch.Tensor)):
        samples = torch.as_tensor(audio, dtype=torch.float32)
        if samples.dim() != 1:
            raise AudioError(f"audio samples must be one channel [n] at 16 kHz, got shape {list(samples.shape)}")
        yield samples
        return
    yield from _decode(audio)


def _decode(audio) -> Iterator[torch.Tensor]:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - a dependency of the speech extra
        raise AudioError("decoding audio files needs PyAV: pip install 'fastdecode[speech]'") from exc
    source = io.BytesIO(audio) if isinstance(audio, bytes) else audio
    if isinstance(source, (str, Path)) and not Path(source).is_file():
        raise AudioError(f"audio file {source} does not exist")
    name = str(source) if isinstance(source, (str, Path)) else "the audio"
    try:
        container = av.open(source if not isinstance(source, Path) else str(source), mode="r")
    except (av.FFmpegError, OSError, ValueError) as exc:
        raise AudioError(f"{name} is not a readable audio file: {exc}") from exc
    with container:
        if not container.streams.audio:
            raise AudioError(f"{name} has no audio stream")
        resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
        try:
            for frame in container.decode(container.streams.audio[0]):
                for out in resampler.resample(frame):
                    yield _float_samples(out)
            for out in resampler.resample(None):  # what the resampler still holds
                yield _float_samples(out)
        except av.FFmpegError as exc:
            raise AudioError(f"{name}: decoding failed: {exc}") from exc


def _float_samples(frame) -> torch.Tensor:
    """A mono s16 frame -> float32 samples [n] in [-1, 1)."""
    return torch.from_numpy(frame.to_ndarray().reshape(-1).astype(np.float32) / 32768.0)  # [1, n] -> [n]


class SampleBuffer:
    """The samples from a position on, pulled from a chunk stream as a window needs them; what lies
    before the position is dropped (bounded memory)."""

    def __init__(self, chunks: Iterator[torch.Tensor]):
        self.chunks = chunks
        self.start = 0  # absolute sample index of buffer[0]
        self.buffer = torch.zeros(0)
        self.exhausted = False

    def window(self, begin: int, length: int) -> torch.Tensor:
        """Samples [begin, begin + length) (fewer at the end of the audio); forgets all before ``begin``."""
        parts, have = [self.buffer], self.start + self.buffer.shape[0]  # have: absolute end of what is held
        while have < begin + length and not self.exhausted:
            chunk = next(self.chunks, None)
            if chunk is None:
                self.exhausted = True
            else:
                parts.append(chunk)
                have += chunk.shape[0]
        buffer = torch.cat(parts) if len(parts) > 1 else self.buffer
        offset = min(max(0, begin - self.start), buffer.shape[0])
        self.buffer, self.start = buffer[offset:].clone() if offset else buffer, self.start + offset
        return self.buffer[:length]

    def ended_before(self, position: int) -> bool:
        """True when the audio holds no sample at ``position``."""
        return self.window(position, 1).shape[0] == 0
