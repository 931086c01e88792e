"""Long-form transcription: 30-second windows in sequence, each seeking from the last timestamp.

Per window (Whisper's algorithm, as faster-whisper runs it): the log-mel features of the 30 s
from ``seek`` (a partial window's missing frames are 0.0, as faster-whisper pads them: speech/features.py's
``long_form_window_features``), the encoder once and each decoder layer's cross K/V once
(speech/batching.py), the language detected from the first window when none is given, then the
search (speech/search.py: a request of the one engine) under the prompt ``<|startofprev|>`` + previous text (the last 223
tokens, starting with ``initial_prompt``) + the special-token prompt. The temperature fallback
retries a window at the next temperature when its text is too repetitive (zlib compression ratio
above ``compression_ratio_threshold``) or too unlikely (average log-probability below
``log_prob_threshold``); a window whose no-speech probability is above ``no_speech_threshold``
and whose text is unlikely is silence and skipped. Segments are the text between timestamp
pairs; ``seek`` moves to the last closed timestamp (the whole window when it ends on one).
With ``word_timestamps`` the window's text is aligned once more (an ``Align`` request:
speech/alignment.py, speech/words.py) and, unless the window ends on a single timestamp, ``seek``
moves to the end of its last word instead.

Feature normalization (the 8-decade floor below the maximum) is per window: the audio is streamed
(speech/audio.py) and a 3-hour file is never whole in memory.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InvalidOptionError
from .audio import AudioInput, SampleBuffer, stream_samples
from .batching import run_alone
from .features import HOP_LENGTH, SAMPLE_RATE, WINDOW_FRAMES, WINDOW_SAMPLES, long_form_window_features
from .loading import WhisperCheckpoint
from .requests import Align, Detect, Encode, Search, Segment, Steps, Transcription
from .search import SearchOptions, WindowResult
from .vocabulary import TIME_PRECISION
from .words import add_words

FRAME_SECONDS = HOP_LENGTH / SAMPLE_RATE  # 0.01
FRAMES_PER_TIMESTAMP = round(TIME_PRECISION / FRAME_SECONDS)  # 2
PREVIOUS_TEXT_TOKENS = 223  # Whisper's n_text_ctx // 2 - 1
PROMPT_RESET_TEMPERATURE = 0.5  # faster-whisper's prompt_reset_on_temperature


@dataclass(frozen=True)
class TranscribeOptions:
    language: str | None = None
    task: str = "transcribe"
    beam_size: int = 5
    best_of: int = 5
    patience: float = 1.0
    temperature: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    log_prob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    initial_prompt: str | None = None
    without_timestamps: bool = False
    max_initial_timestamp: float = 1.0
    word_timestamps: bool = False
    seed: int | None = None

    def check(self) -> None:
        if self.beam_size < 1 or self.best_of < 1:
            raise InvalidOptionError(f"beam_size and best_of must be at least 1, got {self.beam_size}, {self.best_of}")
        if self.patience <= 0:
            raise InvalidOptionError(f"patience must be positive, got {self.patience}")
        if not self.temperature or any(not 0 <= t <= 2 for t in self.temperature):
            raise InvalidOptionError(f"temperature must be one or more values in [0, 2], got {self.temperature}")
        if self.task not in ("transcribe", "translate"):
            raise InvalidOptionError(f"task must be 'transcribe' or 'translate', got {self.task!r}")


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class Transcriber:
    """A loaded Whisper model: ``transcribe(audio, ...)`` -> ``Transcription`` (segments with times).

    A transcription is a generator of model requests (speech/batching.py answers them, one
    transcription alone or many side by side in one batch: the server's requests)."""

    def __init__(self, checkpoint: WhisperCheckpoint):
        self.checkpoint = checkpoint
        self.model, self.vocabulary = checkpoint.model, checkpoint.vocabulary

    @property
    def multilingual(self) -> bool:
        return self.vocabulary.multilingual

    def options(self, language: str | None = None, task: str = "transcribe", beam_size: int = 5,
                word_timestamps: bool = False, **options) -> TranscribeOptions:
        """The options of a transcription, checked (typed errors) before any audio is read."""
        if isinstance(options.get("temperature"), (int, float)):
            options["temperature"] = (float(options["temperature"]),)
        try:
            opts = TranscribeOptions(language=language, task=task, beam_size=beam_size,
                                     word_timestamps=word_timestamps, **options)
        except TypeError as exc:
            raise InvalidOptionError(f"transcribe: {exc}") from exc
        opts.check()
        if language is not None:
            self.vocabulary.language_id(language)  # an unknown language is refused before any decoding
        if task == "translate" and not self.multilingual:
            raise InvalidOptionError("this Whisper model is English-only: it cannot translate")
        return opts

    def transcribe(self, audio: AudioInput, language: str | None = None, task: str = "transcribe",
                   beam_size: int = 5, word_timestamps: bool = False,
                   progress: Callable[[float], None] | None = None, **options) -> Transcription:
        opts = self.options(language, task, beam_size, word_timestamps, **options)
        return run_alone(self.model, self.vocabulary, self.steps(audio, opts, progress))

    # -- the window loop ----------------------------------------------------------------------
    def steps(self, audio: AudioInput, opts: TranscribeOptions, progress=None) -> Steps:
        """The transcription of ``audio`` as model requests (see ``Encode``, ``Detect``, ``Search``)."""
        buffer = SampleBuffer(stream_samples(audio))
        vocab, n_mels = self.vocabulary, self.checkpoint.config.num_mel_bins
        language, language_probability = opts.language, None
        history: list[int] = vocab.encode(" " + opts.initial_prompt.strip()) if opts.initial_prompt else []
        segments: list[Segment] = []
        seek = 0  # frames
        last_speech = 0.0  # seconds: the end of the last word (word timestamps)
        while True:
            samples = buffer.window(seek * HOP_LENGTH, WINDOW_SAMPLES)
            window_frames = min(WINDOW_FRAMES, samples.shape[0] // HOP_LENGTH)
            if window_frames == 0:
                break
            sources = yield Encode(long_form_window_features(samples, n_mels))
            if language is None:
                language, language_probability = (yield Detect(sources)) if vocab.multilingual else ("en", 1.0)
            prompt = ([vocab.sot_prev, *history[-PREVIOUS_TEXT_TOKENS:]] if history else [])
            sot_index = len(prompt)
            prompt += vocab.sot_sequence(language, opts.task, not opts.without_timestamps)
            result, temperature = yield from self._decode_with_fallback(sources, prompt, sot_index, opts)
            if (opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold
                    and (opts.log_prob_threshold is None or result.avg_logprob < opts.log_prob_threshold)):
                seek += window_frames  # silence
            else:
                new, advance, consumed = self._segments(result, seek, window_frames, temperature, len(segments))
                segments += new
                if opts.word_timestamps and new:
                    text = [t for segment in new for t in segment.tokens]
                    timings = yield Align(sources, vocab.sot_sequence(language, opts.task, True), text,
                                          window_frames, tuple(self.checkpoint.alignment_heads), language)
                    last_speech = add_words(new, timings, seek * FRAME_SECONDS, last_speech)
                    tokens, begin = result.tokens, vocab.timestamp_begin
                    single_ending = len(tokens) >= 2 and tokens[-2] < begin <= tokens[-1]
                    ends = [w.end for segment in new for w in segment.words or []]
                    if not single_ending and ends and ends[-1] > seek * FRAME_SECONDS:  # seek to the last word
                        advance = max(1, round(ends[-1] / FRAME_SECONDS) - seek)
                seek += advance
                if opts.condition_on_previous_text and temperature <= PROMPT_RESET_TEMPERATURE:
                    history += consumed
                else:  # a window decoded at a high temperature is not a prompt for the next
                    history = []
            if progress is not None:
                progress(seek * FRAME_SECONDS)
        duration = (buffer.start + buffer.buffer.shape[0]) / SAMPLE_RATE
        return Transcription(segments, language, language_probability, duration, opts.task)

    def search_options(self, opts: TranscribeOptions, temperature: float) -> SearchOptions:
        ckpt = self.checkpoint
        return SearchOptions(
            beam_size=opts.beam_size, patience=opts.patience, temperature=temperature, best_of=opts.best_of,
            max_length=ckpt.config.max_target_positions, timestamps=not opts.without_timestamps,
            suppress_tokens=tuple(ckpt.suppress_tokens), suppress_at_begin=tuple(ckpt.suppress_at_begin),
            max_initial_timestamp_index=round(opts.max_initial_timestamp / TIME_PRECISION), seed=opts.seed)

    def _decode_with_fallback(self, sources, prompt: list[int], sot_index: int, opts: TranscribeOptions):
        """The first result that is neither too repetitive nor too unlikely (or is silence), trying
        the temperatures in turn; when none passes, faster-whisper's choice: the most likely (by
        average log-probability) of those not too repetitive, else of all."""
        tried = []  # (result, temperature, too repetitive)
        for temperature in opts.temperature:
            result = yield Search(sources, prompt, sot_index, self.search_options(opts, temperature))
            text = self.vocabulary.decode(result.tokens)
            too_repetitive = (opts.compression_ratio_threshold is not None
                              and compression_ratio(text) > opts.compression_ratio_threshold)
            too_unlikely = opts.log_prob_threshold is not None and result.avg_logprob < opts.log_prob_threshold
            silent = (opts.no_speech_threshold is not None and result.no_speech_prob > opts.no_speech_threshold
                      and too_unlikely)
            if silent or not (too_repetitive or too_unlikely):
                return result, temperature
            tried.append((result, temperature, too_repetitive))
        candidates = [t for t in tried if not t[2]] or tried
        result, temperature, _ = max(candidates, key=lambda t: t[0].avg_logprob)
        return result, temperature

    def _segments(self, result: WindowResult, seek: int, window_frames: int, temperature: float,
                  first_id: int) -> tuple[list[Segment], int, list[int]]:
        """The window's segments, how many frames ``seek`` advances, and the tokens it consumed (the
        next window's previous text)."""
        vocab, tokens = self.vocabulary, result.tokens
        begin = vocab.timestamp_begin
        offset = seek * FRAME_SECONDS
        is_stamp = [t >= begin for t in tokens]
        segments: list[Segment] = []

        def add(part: list[int], start: float, end: float) -> None:
            text = vocab.decode(part)
            if text.strip():
                segments.append(Segment(first_id + len(segments), round(start, 3), round(end, 3), text,
                                        [t for t in part if t < vocab.eot], result.avg_logprob,
                                        compression_ratio(text), result.no_speech_prob, temperature, seek))

        closing = [i for i in range(1, len(tokens)) if is_stamp[i] and is_stamp[i - 1]]
        single_ending = len(tokens) >= 2 and not is_stamp[-2] and is_stamp[-1]
        if closing:
            cuts = closing + ([len(tokens)] if single_ending else [])
            last = 0
            for cut in cuts:
                part = tokens[last:cut]
                add(part, offset + (part[0] - begin) * TIME_PRECISION, offset + (part[-1] - begin) * TIME_PRECISION)
                last = cut
            advance = window_frames if single_ending else (tokens[last - 1] - begin) * FRAMES_PER_TIMESTAMP
            # the tokens after the last closed timestamp are decoded again from the next window
            return segments, advance if advance > 0 else window_frames, tokens[:last]
        duration = window_frames * FRAME_SECONDS
        stamps = [t for t in tokens if t >= begin]
        if stamps and stamps[-1] != begin:
            duration = (stamps[-1] - begin) * TIME_PRECISION
        add(tokens, offset, offset + duration)
        return segments, window_frames, tokens

