"""Answering transcriptions' model requests, many transcriptions side by side.

A transcription (``Transcriber.steps``) asks for one thing at a time: encode a window, detect its
language, search it under a prompt. ``WindowBatcher.round`` answers every open transcription's
request in as few model calls as possible: the windows to encode in one encoder batch, the
language detections in one decoder step, and the searches with the same options in one search
(their windows' cross K/V side by side, each window's beams folded on its own K/V). A
transcription that fails (an audio file that turns out corrupt) ends with its error; the others
go on. One whose ``cancelled()`` turns true (the server's client went away) leaves before the next
round: its generator is closed and it ends with ``GenerationCancelledError`` (a round in progress, one
window's search, finishes first).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.cross import EncodedSources
from ..errors import GenerationCancelledError
from .engine import WhisperEngine, encode_windows
from .search import search
from .alignment import align_words
from .requests import Align, Detect, Encode, Search, Steps, Transcription
from .vocabulary import WhisperVocabulary


def window_sources(sources: EncodedSources, index: int) -> EncodedSources:
    """Window ``index`` of a batch's cross K/V (views: nothing is copied)."""
    one = copy.copy(sources)
    one.keys = [k[index : index + 1] for k in sources.keys]  # [1, H, S, D] each
    one.values = [v[index : index + 1] for v in sources.values]
    one.valid = sources.valid[index : index + 1]
    one.bias = None
    one.lengths = None if sources.lengths is None else sources.lengths[index : index + 1]
    return one


def stack_sources(parts: list[EncodedSources]) -> EncodedSources:
    """Several windows' cross K/V as one batch (a copy, unless there is one part)."""
    if len(parts) == 1:
        return parts[0]
    layers = range(len(parts[0].keys))
    return EncodedSources([torch.cat([p.keys[i] for p in parts]) for i in layers],
                          [torch.cat([p.values[i] for p in parts]) for i in layers],
                          torch.cat([p.valid for p in parts]))


@dataclass
class _Open:
    steps: Steps
    request: Encode | Detect | Search | Align
    done: Callable[[Transcription | BaseException], None]
    cancelled: Callable[[], bool] | None = None


class WindowBatcher:
    def __init__(self, model, vocabulary: WhisperVocabulary):
        self.model, self.vocabulary = model, vocabulary
        self.open: list[_Open] = []

    def add(self, steps: Steps, done: Callable[[Transcription | BaseException], None],
            cancelled: Callable[[], bool] | None = None) -> None:
        """Start a transcription; ``done`` gets its result (or its error) when it ends; it is
        dropped once ``cancelled()`` is true."""
        self._advance(steps, None, done, cancelled, first=True)

    def _advance(self, steps: Steps, answer, done, cancelled=None, first: bool = False) -> None:
        try:
            request = next(steps) if first else steps.send(answer)
        except StopIteration as stop:
            done(stop.value)
        except Exception as exc:  # noqa: BLE001 - this transcription ends with its error, the others go on
            done(exc)
        else:
            self.open.append(_Open(steps, request, done, cancelled))

    def drop_cancelled(self) -> None:
        """End the open transcriptions whose ``cancelled()`` is true (their generators closed)."""
        keep = []
        for o in self.open:
            if o.cancelled is not None and o.cancelled():
                o.steps.close()
                o.done(GenerationCancelledError("the transcription was cancelled"))
            else:
                keep.append(o)
        self.open = keep

    def round(self) -> None:
        """Answer every open transcription's request once."""
        self.drop_cancelled()
        model, vocab = self.model, self.vocabulary
        asking, self.open = self.open, []
        answers: dict[int, object] = {}
        with torch.inference_mode():
            encodes = [i for i, o in enumerate(asking) if isinstance(o.request, Encode)]
            if encodes:
                batch = encode_windows(model, torch.stack([asking[i].request.features for i in encodes]))  # [B, M, T]
                answers.update({i: window_sources(batch, n) for n, i in enumerate(encodes)})
            detects = [i for i, o in enumerate(asking) if isinstance(o.request, Detect)]
            if detects:
                answers.update(zip(detects, self._detect([asking[i].request.sources for i in detects])))
            groups: dict[object, list[int]] = {}
            for i, o in enumerate(asking):
                if isinstance(o.request, Search):
                    groups.setdefault(o.request.options, []).append(i)
            for options, members in groups.items():
                requests = [asking[i].request for i in members]
                sources = stack_sources([r.sources for r in requests])
                rows = options.best_of if options.temperature > 0 else options.beam_size
                engine = WhisperEngine(model, sources, rows, options.max_length)
                results = search(engine, vocab, [r.prompt for r in requests], [r.sot_index for r in requests], options)
                answers.update(zip(members, results))
            for i, o in enumerate(asking):  # word alignments: one forward each
                if isinstance(o.request, Align):
                    r = o.request
                    answers[i] = align_words(model, vocab, r.sources, r.sot_sequence, r.text_tokens, r.num_frames,
                                             list(r.heads), r.language)
        for i, o in enumerate(asking):
            self._advance(o.steps, answers[i], o.done, o.cancelled)

    def _detect(self, windows: list[EncodedSources]) -> list[tuple[str, float]]:
        """The most likely language token after ``<|startoftranscript|>``, per window."""
        vocab = self.vocabulary
        engine = WhisperEngine(self.model, stack_sources(windows), 1, 1)
        logits, _ = engine.start([[vocab.sot]] * len(windows), [0] * len(windows))  # [B, V]
        ids = torch.tensor(list(vocab.languages.values()), device=logits.device)
        probs = logits[:, ids].float().softmax(dim=-1)  # [B, languages]
        best = probs.argmax(dim=-1)
        return [(vocab.language_code(int(ids[b])), float(probs[row, b])) for row, b in enumerate(best.tolist())]


def run_alone(model, vocabulary: WhisperVocabulary, steps: Steps) -> Transcription:
    """One transcription, its requests answered as they come."""
    batcher, out = WindowBatcher(model, vocabulary), []
    batcher.add(steps, out.append)
    while batcher.open:
        batcher.round()
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]
