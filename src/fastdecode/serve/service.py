"""From a validated request to a stream of pieces: tokenize, pick the route, submit, collect.

Two routes, both into the one engine:
* the engine (continuous batching; every greedy / sampling / beam search request that fits the
  context, to a decoder-only or an encoder-decoder model). A beam search (``num_beams > 1``) is one
  submission per prompt whose group gives its ``n`` choices, each one final piece when the search
  ends (engine/beam_group.py),
* conversations longer than the context with ``--context-overflow shift|reevaluate``: engine
  streams (sinks + shift / re-evaluate), kept between turns (``kept_streams.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from .. import validation
from ..errors import FastDecodeError
from .metrics import ServerMetrics
from .extras import fill_in_middle_ids, predicted_speculation
from .protocol import APIError, GenerationRequest, api_error_from
from .kept_streams import KeptStreams
from .structured import compile_off_thread
from .tools import render_messages
from .worker import Admitted, EngineWorker, Failed, Piece, RequestSink, Submission

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServeSettings:
    model_name: str = "fastdecode"
    model_aliases: tuple[str, ...] = ()  # more names the model answers to (--served-model-name)
    strict_model_name: bool = False  # another name is a 404 (default: a one-model server answers any)
    allowed_origins: tuple[str, ...] = ()  # CORS: browser origins allowed to call the API ("*": any)
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_batch_tokens: int = 2048
    max_queue: int = 256
    n_ctx: int | None = None  # the context a request may use (default: the model's)
    n_keep: int = 4
    context_overflow: str = "error"  # "shift", "reevaluate" or "error"
    grace_seconds: float = 30.0  # SIGTERM: how long in-flight requests may still run
    header_timeout: float = 5.0  # seconds a request's headers may take to arrive (connections.py)
    body_timeout: float = 10.0  # seconds its body may take after them
    keep_alive_timeout: float = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's own)
    max_connections: int = 1024  # open connections; beyond it a new one gets 503
    embeddings: str | None = None  # "mean" or "last": serve /v1/embeddings with that pooling (--embeddings)
    lenient: bool = False  # unknown request fields: logged and ignored instead of a 400 (fields.py)
    speculative: Any = None  # the default ``speculative`` option of greedy / sampling requests (--speculative)


_CANCELLED = object()  # put in a request's queue when it is cancelled: wakes whoever waits on it


class RunningRequest:
    """The submissions of one request and the pieces they produce."""

    def __init__(self, sink: RequestSink, submissions: list[Submission], cancel: Callable[[], None],
                 prompt_lengths: list[int]):
        self.sink, self.submissions, self._cancel = sink, submissions, cancel
        self.prompt_lengths = prompt_lengths
        self._buffer: list[Piece] = []
        self.done = False
        self.cancelled = False  # stopped before every choice finished (the client went away)

    def cancel(self) -> None:
        """Stop every submission (the engine frees their blocks at its next step); call on the event loop."""
        if not self.done:
            self.done = self.cancelled = True
            self._cancel()
            self.sink.queue.put_nowait(_CANCELLED)

    async def admitted(self) -> None:
        """Wait until every submission is accepted; raise the first rejection (after cancelling the rest)."""
        waiting = {index for s in self.submissions for index in s.choice_indices}
        while waiting and not self.cancelled:
            item = await self.sink.queue.get()
            if isinstance(item, Failed):
                self.cancel()
                raise item.error
            if isinstance(item, Admitted):
                waiting.discard(item.index)
            elif item is not _CANCELLED:
                self._buffer.append(item)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Every piece until each choice has finished, or until the request is cancelled; cancels
        everything if the consumer stops early."""
        open_choices = {index for s in self.submissions for index in s.choice_indices}
        try:
            while open_choices and not self.cancelled:
                item = self._buffer.pop(0) if self._buffer else await self.sink.queue.get()
                if isinstance(item, Failed):
                    raise item.error
                if isinstance(item, Piece):
                    if item.finish_reason is not None:
                        open_choices.discard(item.index)
                    yield item
            self.done = True
        finally:
            self.cancel()


class GenerationService:
    def __init__(self, generator: Any, settings: ServeSettings, metrics: ServerMetrics):
        self.generator, self.settings, self.metrics = generator, settings, metrics
        config = generator.config
        self.encoder_decoder = config.is_encoder_decoder
        self.context = settings.n_ctx or config.max_position_embeddings
        if settings.n_ctx is not None and settings.n_ctx > config.max_position_embeddings:
            raise APIError(400, f"n_ctx={settings.n_ctx} exceeds the model's context "
                                f"({config.max_position_embeddings} positions)")
        self.overflow = settings.context_overflow in ("shift", "reevaluate") and not self.encoder_decoder
        if not self.overflow and settings.n_keep != ServeSettings.n_keep:
            raise APIError(400, f"n_keep={settings.n_keep} applies only to conversations past the context, which "
                                "this server answers with an error: set --context-overflow shift or reevaluate"
                                + (" (an encoder-decoder model has none)" if self.encoder_decoder else ""))
        streaming = {"n_ctx": self.context, "n_keep": settings.n_keep, "policy": settings.context_overflow}
        self.streams = KeptStreams(generator, streaming) if self.overflow else None
        self.worker = EngineWorker(
            lambda: generator.engine(max_batch_tokens=settings.max_batch_tokens, max_queue=settings.max_queue),
            metrics, self.streams)
        if self.overflow:
            try:
                generator.requests.generation_config(streaming)
            except FastDecodeError as exc:
                raise APIError(400, f"bad streaming settings: {exc}") from exc

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    def active_sequences(self) -> int:
        return self.worker.active_sequences()

    # -- preparing -------------------------------------------------------------------------------
    def encode(self, request: GenerationRequest) -> list[tuple[list[int], str | None]]:
        """-> (prompt ids, the text they encode or None for token prompts) per prompt."""
        gen = self.generator
        too_large = [t for t in request.options.get("logit_bias", {}) if t >= gen.config.vocab_size]
        if too_large:
            raise APIError(400, f"logit_bias names token id {too_large[0]}, past the vocabulary "
                                f"({gen.config.vocab_size} tokens)", param="logit_bias")
        if request.endpoint == "chat" and self.encoder_decoder:
            raise APIError(400, "this is an encoder-decoder model: it has no chat; send the source text to "
                                "/v1/completions as the prompt", param="messages", code="unsupported_model")
        try:
            if request.endpoint == "chat":
                tokenizer = gen.requests.require_tokenizer()
                messages, extra = render_messages(request.prompts[0], request.tools, tokenizer.chat_template)
                text = tokenizer.apply_chat_template(validation.check_chat(messages), add_generation_prompt=True,
                                                     **extra)
                return [(tokenizer.encode(text, add_special_tokens=False), text)]
            if request.suffix is not None:
                return [(fill_in_middle_ids(gen.requests.require_tokenizer(), p, request.suffix), None)
                        for p in request.prompts]
            return [(gen.encode_prompt(p), p) if isinstance(p, str) else (list(p), None) for p in request.prompts]
        except FastDecodeError as exc:
            raise APIError(400, str(exc), param="messages" if request.endpoint == "chat" else "prompt") from exc

    def _route(self, request: GenerationRequest, prompt: list[int]) -> tuple[str, dict[str, Any]]:
        """-> ("engine" | "stream", options with max_new_tokens filled in)."""
        options = dict(request.options)
        room = self.context - len(prompt)
        if options["max_new_tokens"] is None:
            if request.endpoint == "completion" or self.encoder_decoder:
                options["max_new_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
            else:
                options["max_new_tokens"] = room if room > 0 else self.context // 2
        route = "engine"
        if not self.encoder_decoder and len(prompt) + options["max_new_tokens"] > self.context:
            if not self.overflow or request.is_beam:
                why = "beam search cannot use a streaming cache" if request.is_beam and self.overflow else (
                    "start the server with --n-ctx N --context-overflow shift (or reevaluate) to go on past it")
                raise APIError(400, f"the prompt has {len(prompt)} tokens; with max_tokens="
                                    f"{options['max_new_tokens']} it needs {len(prompt) + options['max_new_tokens']} "
                                    f"positions but the context is {self.context} ({why})",
                               param="max_tokens", code="context_length_exceeded")
            route = "stream"
        if (self.settings.speculative is not None and "speculative" not in options and route == "engine"
                and not request.is_beam):
            options["speculative"] = self.settings.speculative  # the server's default, where speculation runs
        if request.prediction is not None:  # drafts from the predicted output (OpenAI's predicted outputs)
            options["speculative"] = predicted_speculation(options.get("speculative"), self.generator.tokenizer,
                                                           request.prediction)
        return route, options

    # -- running ---------------------------------------------------------------------------------
    async def start_request(self, request: GenerationRequest,
                            encoded: list[tuple[list[int], str | None]]) -> RunningRequest:
        """Submit every choice of every prompt; return once all are accepted (else raise APIError)."""
        arrived = time.perf_counter()
        await compile_off_thread(self.generator, request)  # the engine thread then finds it cached
        prompts = [ids for ids, _ in encoded]
        sink = RequestSink(asyncio.get_running_loop())
        routes = [self._route(request, p) for p in prompts]
        submissions = []
        count = request.candidates
        # a beam search is one submission per prompt: its group answers the prompt's n choices
        per_prompt, choices = (1, count) if request.is_beam else (count, 1)
        # best_of ranks its candidates by cumulative logprob: they need at least the chosen tokens'
        logprobs = 0 if request.logprobs is None and count > request.n else request.logprobs
        for p, (prompt, (route, options)) in enumerate(zip(prompts, routes)):
            for j in range(per_prompt):
                choice = dict(options)
                if choice.get("seed") is not None:
                    choice["seed"] += j  # choice j of a seeded request = an offline run with seed + j
                choice["logprobs"] = logprobs
                submission = Submission(p * count + j, prompt, choice, sink, arrived, choices)
                submission.route, submission.prompt_text = route, encoded[p][1]
                if route != "engine":
                    self._check_loop_options(submission)
                submissions.append(submission)
        for submission in submissions:
            self.worker.submit(submission)

        def cancel() -> None:
            for submission in submissions:
                submission.cancelled = True
                self.worker.cancel(submission)

        running = RunningRequest(sink, submissions, cancel, [len(p) for p in prompts])
        await running.admitted()
        return running

    def _check_loop_options(self, submission: Submission) -> None:
        try:
            options = dict(self.streams.options(submission.options))
            options.pop("logprobs", None)
            self.generator.requests.generation_config(options)  # GenerationConfig's rules, before anything is queued
        except FastDecodeError as exc:
            raise api_error_from(exc) from exc
