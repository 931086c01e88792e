"""The one thread that owns the engine: it submits, steps and cancels; handlers never block it.

Handlers (on the asyncio event loop) hand work over through a thread-safe queue (``submit`` /
``cancel``). The thread drains that queue, runs one ``engine.step()`` and pushes each token to
its request's asyncio queue with ``loop.call_soon_threadsafe``, so neither side ever waits for
the other: a slow client only fills its own queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import FastDecodeError
from .metrics import ServerMetrics
from .protocol import APIError, api_error_from

log = logging.getLogger("fastdecode.serve")


@dataclass
class Piece:
    """One generated token of one choice, as the handler needs it (plain data, no engine objects)."""

    index: int  # choice index within the request
    token_id: int
    text: str
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None  # the stop string that ended the choice (finish_reason "stop"), if one did
    drafted_tokens: int = 0  # speculative decoding, set on the last piece: tokens drafted and verified
    accepted_tokens: int = 0  # ... and of those, accepted


@dataclass
class Admitted:
    index: int


@dataclass
class Failed:
    index: int
    error: APIError


class RequestSink:
    """A request's asyncio queue, fed from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class Submission:
    """One sequence a request asked for (a request with n choices makes n of them)."""

    def __init__(self, index: int, prompt_ids: list[int], options: dict[str, Any], sink: RequestSink,
                 arrived: float):
        self.index, self.prompt_ids, self.options, self.sink, self.arrived = index, prompt_ids, options, sink, arrived
        self.prompt_text: str | None = None  # the text the prompt was encoded from (chat rendering), if any
        self.route = "engine"  # "engine" or "stream" (a conversation past the context: a kept engine stream)
        self.sequence: Any = None
        self.last_token_at: float | None = None
        self.cancelled = False

    def start(self, engine: Any) -> Any:
        """Queue this submission's sequence in ``engine`` (on the engine thread) -> the sequence."""
        return engine.submit(self.prompt_ids, self.options)


class EngineWorker:
    def __init__(self, make_engine: Callable[[], Any], metrics: ServerMetrics, streams: Any = None):
        """``streams``: the kept conversations past the context (kept_streams.KeptStreams), or None."""
        self._make_engine = make_engine
        self.streams = streams
        self.engine = make_engine()
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, Submission] = {}  # sequence id -> submission
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fastdecode-engine", daemon=True)

    # -- called from the event loop --------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout)

    def submit(self, submission: Submission) -> None:
        self._inbox.put(("submit", submission))

    def cancel(self, submission: Submission) -> None:
        self._inbox.put(("cancel", submission))

    def active_sequences(self) -> int:
        return len(self._active)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if self.engine.has_work():
                self._step()
        for submission in list(self._active.values()):
            self._finish(submission, Failed(submission.index, APIError(503, "the server is shutting down",
                                                                       "server_busy", code="shutting_down")))

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, submission = item
            if kind == "submit":
                self._admit(submission)
            elif kind == "cancel":
                submission.cancelled = True
                if submission.sequence is not None and not submission.sequence.finished:
                    submission.sequence.cancel()
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, submission: Submission) -> None:
        if submission.cancelled:
            return
        try:
            if submission.route == "stream":
                submission.sequence = self.streams.submit(self.engine, submission.prompt_ids, submission.prompt_text,
                                                          submission.options)
            else:
                submission.sequence = submission.start(self.engine)
        except FastDecodeError as exc:
            submission.sink.put(Failed(submission.index, api_error_from(exc)))
            return
        self._active[submission.sequence.id] = submission
        self.metrics.waiting.inc()
        submission.sink.put(Admitted(submission.index))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:  # a bug, not bad input: fail what was running, start a fresh engine
            log.exception("engine step failed")
            for submission in list(self._active.values()):
                self._finish(submission, Failed(submission.index, APIError(
                    500, f"internal error while generating: {exc}", "server_error", code="internal_error")))
            self.engine = self._make_engine()
            if self.streams is not None:
                self.streams.forget()
            return
        now = time.perf_counter()
        for event in events:
            submission = self._active.get(event.sequence.id)
            if submission is None:
                continue
            sequence = event.sequence
            if event.finish_reason == "cancelled":
                self._finish(submission, None)
                continue
            if event.token_id is not None and event.token_id >= 0:
                self._record_latency(submission, now)
            piece = Piece(submission.index, event.token_id, event.text, event.logprob, event.top_logprobs,
                          event.finish_reason if event.finished else None, sequence.num_prompt_tokens,
                          sequence.num_cached_prompt_tokens, len(sequence.output_ids))
            if event.finished:
                piece.stop_sequence = matched_stop(sequence)
                if sequence.speculation is not None:
                    piece.drafted_tokens = sequence.speculation.drafted
                    piece.accepted_tokens = sequence.speculation.accepted
                self._finish(submission, piece)
            else:
                submission.sink.put(piece)
        for sequence_id, submission in list(self._active.items()):  # cancelled without an event
            if submission.sequence.finished and submission.sequence.finish_reason == "cancelled":
                self._finish(submission, None)
        if self.streams is not None:
            self.streams.make_room(self.engine)

    def _record_latency(self, submission: Submission, now: float) -> None:
        if submission.last_token_at is None:
            self.metrics.ttft.observe(now - submission.arrived)
            self.metrics.waiting.dec()
            self.metrics.running.inc()
        else:
            self.metrics.inter_token.observe(now - submission.last_token_at)
        submission.last_token_at = now
        self.metrics.generated_tokens.inc()

    def _finish(self, submission: Submission, last: Any) -> None:
        sequence = submission.sequence
        self._active.pop(sequence.id, None)
        (self.metrics.running if submission.last_token_at is not None else self.metrics.waiting).dec()
        self.metrics.prompt_tokens.inc(sequence.num_prompt_tokens)
        self.metrics.cached_prompt_tokens.inc(sequence.num_cached_prompt_tokens)
        if submission.route == "stream" and sequence.finished:
            self.streams.finished(self.engine, sequence, submission.prompt_text)
        if last is not None:
            submission.sink.put(last)


def matched_stop(sequence: Any) -> str | None:
    """The stop string that ended ``sequence`` (its text stops where that string starts), or None."""
    matcher = getattr(sequence.watcher, "matcher", None)
    if sequence.stop_kind != "stop" or not hasattr(matcher, "stops"):
        return None
    rest = matcher.text[len(matcher.output):]
    return next((stop for stop in matcher.stops if rest.startswith(stop)), None)
