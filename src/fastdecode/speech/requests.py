"""What a transcription asks of the model, one request at a time, and what it returns.

``Transcriber.steps`` (transcribe.py) is a generator of these requests; speech/batching.py answers
them, for one transcription or for many side by side.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field

import torch

from .search import SearchOptions


@dataclass
class Word:
    word: str
    start: float
    end: float
    probability: float


@dataclass
class Segment:
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float
    seek: int
    words: list[Word] | None = None  # with word_timestamps


@dataclass
class Transcription:
    segments: list[Segment]
    language: str | None
    language_probability: float | None
    duration: float
    task: str = "transcribe"
    text: str = field(init=False)

    def __post_init__(self):
        self.text = "".join(s.text for s in self.segments).strip()


@dataclass(frozen=True)
class Encode:
    """A transcription's request: encode this window's features [M, 3000] -> its EncodedSources."""
    features: torch.Tensor


@dataclass(frozen=True)
class Detect:
    """-> (language code, probability) from the window's first decoder step."""
    sources: object


@dataclass(frozen=True)
class Search:
    """-> the WindowResult of one search of the window under this prompt."""
    sources: object
    prompt: list[int]
    sot_index: int
    options: SearchOptions


@dataclass(frozen=True)
class Align:
    """-> the WordTimings of ``text_tokens`` in the window (speech/alignment.py's ``align_words``)."""
    sources: object
    sot_sequence: list[int]
    text_tokens: list[int]
    num_frames: int
    heads: tuple[tuple[int, int], ...]
    language: str | None


Steps = Generator[Encode | Detect | Search | Align, object, Transcription]
