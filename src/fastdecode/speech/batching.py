"""Answering transcriptions' model requests, many transcriptions side by side in one engine.

A transcription (``Transcriber.steps``) asks for one thing at a time: encode a window, detect its
language, search it under a prompt, align its words. ``WindowBatcher.round`` answers what it
can: the windows to encode in one encoder batch (each window's cross K/V once, kept by its
transcription for every later request of that window), the word alignments (one forward each),
and the language detections and searches as requests of the one ``Engine``
(engine/scheduler.py): a search is a group of sequences whose source is the encoded window
(engine/speech_source.py) and whose policy is Whisper's search (speech/search.py). Each round
runs one engine step, so the rows of every open search (greedy, beams, samples, detections)
share each forward, and a transcription that arrives or moves to its next window joins the next
step. A transcription that fails (an audio file that turns out corrupt) ends with its error; the
others go on. One whose ``cancelled()`` turns true (the server's client went away) leaves before
the next round: its engine request is cancelled, its generator closed and it ends with
``GenerationCancelledError``.

The engine is made at the first request and lives on; its cache's memory is zeroed lazily and its
blocks reused warm first (engine/blocks.py), so what is resident is what the most searches at
once have used.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import GenerationConfig
from ..engine.beam_group import group_blocks
from ..engine.cross import EncodedSources
from ..engine.requests import Request, RequestFactory
from ..engine.core import Engine
from ..errors import GenerationCancelledError
from .alignment import align_words
from .requests import Align, Detect, Encode, Search, Steps, Transcription
from .search import LanguageDetection, SearchOptions, WindowResult, WindowSearch
from .vocabulary import WhisperVocabulary

CACHE_WINDOWS = 8  # beam-5 windows of the longest decoding the engine's cache holds at once
BLOCK_SIZE = 16  # the engine's cache block, in tokens


def encode_windows(model, features: torch.Tensor) -> EncodedSources:
    """Log-mel windows [B, M, 3000] -> each decoder layer's cross K/V of every window, once."""
    memory = model.encode(features)  # [B, 1500, C]
    valid = torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)  # [B, 1500]
    return EncodedSources.from_memory(model, memory, valid)


def window_sources(sources: EncodedSources, index: int) -> EncodedSources:
    """Window ``index`` of a batch's cross K/V (views: nothing is copied)."""
    one = copy.copy(sources)
    one.keys = [k[index : index + 1] for k in sources.keys]  # [1, H, S, D] each
    one.values = [v[index : index + 1] for v in sources.values]
    one.valid = sources.valid[index : index + 1]
    one.bias = None
    one.lengths = None if sources.lengths is None else sources.lengths[index : index + 1]
    return one


def search_request(vocabulary: WhisperVocabulary, request: Search, vocab_size: int,
                   device: torch.device) -> Request:
    """A window's search as an engine request: its encoded window as the source, the prompt as
    the decoder's, a group of ``options.rows`` rows under Whisper's search."""
    options = request.options
    policy = WindowSearch(vocabulary, options, len(request.prompt), vocab_size, device)
    config = GenerationConfig(max_new_tokens=policy.max_new, num_beams=policy.K)
    return Request(list(request.prompt), config, None, [vocabulary.eot], source=request.sources, policy=policy,
                   prompt_logits_at=request.sot_index)


def detect_request(vocabulary: WhisperVocabulary, request: Detect) -> Request:
    """A language detection as an engine request: one step after <|startoftranscript|>."""
    config = GenerationConfig(max_new_tokens=1)
    return Request([vocabulary.sot], config, None, [vocabulary.eot], source=request.sources,
                   policy=LanguageDetection(vocabulary))


def answer(sequence, vocabulary: WhisperVocabulary) -> Any:
    """A finished engine request's answer to its transcription."""
    policy = sequence.group.scores
    if isinstance(policy, LanguageDetection):
        return policy.language
    return policy.window_result(sequence.prompt_logits, vocabulary.no_speech)


def window_tokens(model, rows: int) -> int:
    """Cache slots a window's group of ``rows`` rows may hold at most (the longest decoding: a
    one-token prompt, then every decoder position)."""
    positions = model.config.max_position_embeddings
    return BLOCK_SIZE * group_blocks(1, positions - 1, rows, BLOCK_SIZE)


def speech_engine(model, cache_tokens: int) -> Engine:
    """An engine for a Whisper model (its requests come built: ``search_request``, ``detect_request``)."""
    requests = RequestFactory(model.config, None, dtype=model.dtype, device=model.device)
    return Engine(model, requests, cache_tokens=cache_tokens, max_queue=1 << 20, block_size=BLOCK_SIZE)


def decode_windows(model, vocabulary: WhisperVocabulary, sources: EncodedSources, prompts: list[list[int]],
                   sot_index: list[int], options: SearchOptions) -> list[WindowResult]:
    """Search B encoded windows (``encode_windows``) side by side in one engine, window b under
    ``prompts[b]`` whose <|startoftranscript|> is at ``sot_index[b]`` -> one result each."""
    engine = speech_engine(model, max(1, len(prompts)) * window_tokens(model, options.rows))
    sequences = [engine.add(search_request(vocabulary, Search(window_sources(sources, b), prompt, sot, options),
                                           model.config.vocab_size, model.device))
                 for b, (prompt, sot) in enumerate(zip(prompts, sot_index))]
    while engine.has_work():
        engine.step()
    return [answer(sequence, vocabulary) for sequence in sequences]


@dataclass
class _Open:
    steps: Steps
    request: Encode | Detect | Search | Align
    done: Callable[[Transcription | BaseException], None]
    cancelled: Callable[[], bool] | None = None
    sequence: Any = None  # its engine request while one runs


class WindowBatcher:
    def __init__(self, model, vocabulary: WhisperVocabulary, cache_windows: int = CACHE_WINDOWS):
        self.model, self.vocabulary = model, vocabulary
        self.open: list[_Open] = []
        self.cache_tokens = cache_windows * window_tokens(model, 5)
        self.engine: Engine | None = None

    def add(self, steps: Steps, done: Callable[[Transcription | BaseException], None],
            cancelled: Callable[[], bool] | None = None) -> None:
        """Start a transcription; ``done`` gets its result (or its error) when it ends; it is
        dropped once ``cancelled()`` is true."""
        self._advance(steps, None, done, cancelled, first=True)

    def _advance(self, steps: Steps, reply, done, cancelled=None, first: bool = False) -> None:
        try:
            request = next(steps) if first else steps.send(reply)
        except StopIteration as stop:
            done(stop.value)
        except Exception as exc:  # noqa: BLE001 - this transcription ends with its error, the others go on
            done(exc)
        else:
            self.open.append(_Open(steps, request, done, cancelled))

    def drop_cancelled(self) -> None:
        """End the open transcriptions whose ``cancelled()`` is true (their engine requests
        cancelled, their generators closed)."""
        keep = []
        for o in self.open:
            if o.cancelled is not None and o.cancelled():
                if o.sequence is not None:
                    o.sequence.cancel()
                o.steps.close()
                o.done(GenerationCancelledError("the transcription was cancelled"))
            else:
                keep.append(o)
        self.open = keep

    def _engine(self) -> Engine:
        if self.engine is None:
            self.engine = speech_engine(self.model, self.cache_tokens)
        return self.engine

    def round(self) -> None:
        """Answer what can be answered now: encodes and alignments at once, then one engine step
        for the detections and searches (those that end answer their transcriptions)."""
        self.drop_cancelled()
        try:
            answers = self._answers()
        except BaseException:
            self.engine = None  # the round's transcriptions end with its error (serve/audio.py), their requests too
            raise
        vocab = self.vocabulary
        for o in self.open:
            if o.sequence is not None and o.sequence.finished and id(o) not in answers:
                answers[id(o)] = answer(o.sequence, vocab)
        asking, self.open = self.open, []
        for o in asking:
            if id(o) in answers:
                reply = answers[id(o)]
                if isinstance(reply, BaseException):
                    o.steps.close()
                    o.done(reply)
                else:
                    self._advance(o.steps, reply, o.done, o.cancelled)
            else:
                self.open.append(o)

    def _answers(self) -> dict[int, Any]:
        """Encode, align and submit what the open transcriptions ask, then one engine step ->
        the answers ready now, by ``id`` of the open transcription."""
        model, vocab = self.model, self.vocabulary
        answers: dict[int, Any] = {}
        with torch.inference_mode():
            encodes = [o for o in self.open if isinstance(o.request, Encode)]
            if encodes:
                batch = encode_windows(model, torch.stack([o.request.features for o in encodes]))  # [B, M, T]
                answers.update({id(o): window_sources(batch, n) for n, o in enumerate(encodes)})
            for o in self.open:
                if isinstance(o.request, Align):  # word alignments: one forward each
                    r = o.request
                    answers[id(o)] = align_words(model, vocab, r.sources, r.sot_sequence, r.text_tokens,
                                                 r.num_frames, list(r.heads), r.language)
                elif isinstance(o.request, (Detect, Search)) and o.sequence is None:
                    self._submit(o, answers)
            if self.engine is not None and self.engine.has_work():
                self.engine.step()
        return answers

    def _submit(self, o: _Open, answers: dict[int, Any]) -> None:
        """Queue a transcription's detection or search in the engine (a request it refuses ends
        that transcription with the error)."""
        vocab, model = self.vocabulary, self.model
        if isinstance(o.request, Detect):
            request = detect_request(vocab, o.request)
        else:
            request = search_request(vocab, o.request, model.config.vocab_size, model.device)
        try:
            o.sequence = self._engine().add(request)
        except Exception as exc:  # noqa: BLE001 - a request the engine refuses ends its transcription
            answers[id(o)] = exc


def run_alone(model, vocabulary: WhisperVocabulary, steps: Steps) -> Transcription:
    """One transcription, its requests answered as they come."""
    batcher, out = WindowBatcher(model, vocabulary), []
    batcher.add(steps, out.append)
    while batcher.open:
        batcher.round()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
