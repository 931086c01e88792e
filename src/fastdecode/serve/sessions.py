"""Conversations longer than the context, one at a time on their own thread, through the
generator's own decode loop over a streaming cache.

With ``--n-ctx`` and ``--context-overflow shift|reevaluate``, such a request runs through a
streaming cache (``n_keep`` attention sinks + a window that shifts or is re-evaluated,
``generation/streaming.py``) instead of failing. The server is stateless
(each request carries the whole conversation), so the caches of recent conversations are kept:
a request whose tokens start with what a kept cache has consumed continues that cache and feeds
only its new tokens, however long the conversation has grown (llama.cpp's ``cache_prompt`` with
context shift). Unlike the scheduler, these run one at a time on their own thread: a streaming
cache is a batch of one.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..engine.sequence import public_finish_reason
from ..errors import FastDecodeError
from ..generation.decode import DecodeLoop
from ..generation.stopping import TextWatcher
from ..generation.streaming import streaming_engine
from .metrics import ServerMetrics
from .protocol import APIError, api_error_from
from .worker import Admitted, Failed, Piece, Submission

log = logging.getLogger("fastdecode.serve")


class _Conversation:
    def __init__(self, engine: Any):
        self.engine = engine
        self.fed: list[int] = []  # tokens the cache has consumed (evicted ones included)
        self.fed_text: str | None = None  # their text (prompt text + generated tokens), when the prompt had one
        self.pending: list[int] = []  # the last generated token: produced, not yet fed


class LoopRunner:
    """``streaming``: the n_ctx / n_keep / policy options of conversations past the context, or
    None when the server answers those with 400 (then nothing comes here)."""

    def __init__(self, generator: Any, streaming: dict[str, Any] | None, metrics: ServerMetrics,
                 max_conversations: int = 4):
        self.generator = generator
        self.streaming = streaming
        self.metrics = metrics
        self.max_conversations = max_conversations
        self._kept: list[_Conversation] = []  # least recently used first
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="fastdecode-loops")

    def check(self, submission: Submission) -> None:
        """Reject bad options before anything is queued (GenerationConfig's and the prompt's rules)."""
        self._config(submission)

    def _config(self, submission: Submission) -> Any:
        return self.generator.requests.generation_config({**submission.options, **(self.streaming or {})})

    def submit(self, submission: Submission) -> None:
        self._executor.submit(self._run, submission)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _take(self, prompt: list[int], text: str | None, config: Any) -> tuple[_Conversation, list[int], int]:
        """The kept conversation this prompt continues (removed from the store), the tokens still
        to feed, and how many prompt tokens the cache already holds; a fresh cache when none does.

        Text prompts (chat renderings, completion strings) are matched on text, as ChatSession
        does: a reply re-tokenized inside the next turn's rendering need not give the tokens that
        were generated, but its text is the same. Token prompts are matched on tokens.
        """
        for conversation in reversed(self._kept):
            new = self._continuation(conversation, prompt, text)
            if new is not None:
                self._kept.remove(conversation)
                return conversation, new, len(conversation.fed)
        return _Conversation(streaming_engine(self.generator.model, config)), prompt, 0

    def _continuation(self, conversation: _Conversation, prompt: list[int], text: str | None) -> list[int] | None:
        if text is not None and conversation.fed_text is not None:
            if len(text) > len(conversation.fed_text) and text.startswith(conversation.fed_text):
                suffix = text[len(conversation.fed_text):]
                return conversation.pending + self.generator.tokenizer.encode(suffix, add_special_tokens=False)
            return None
        n = len(conversation.fed)
        if n < len(prompt) and prompt[:n] == conversation.fed:
            return prompt[n:]
        return None

    def _keep(self, conversation: _Conversation) -> None:
        self._kept.append(conversation)
        del self._kept[: -self.max_conversations]

    def _run(self, submission: Submission) -> None:
        if submission.cancelled:
            return
        try:
            self._generate(submission)
        except FastDecodeError as exc:
            submission.sink.put(Failed(submission.index, api_error_from(exc)))
        except Exception as exc:  # a bug: answer it, keep serving
            log.exception("generation on the loop thread failed")
            submission.sink.put(Failed(submission.index, APIError(500, f"internal error: {exc}", "server_error")))

    def _generate(self, submission: Submission) -> None:
        gen, prompt = self.generator, submission.prompt_ids
        config = self._config(submission)
        conversation, new_ids, cached = self._take(prompt, submission.prompt_text, config)
        loop = DecodeLoop(gen.model, [new_ids], config, gen.requests.eos_ids(config), engine=conversation.engine,
                          grammar=gen.grammar_for(config))
        watcher = TextWatcher(gen.requests.require_tokenizer(), config.stop_strings())
        submission.sink.put(Admitted(submission.index))
        generated: list[int] = []
        last_at = None
        try:
            with torch.inference_mode():
                for ((_, token),) in loop:
                    now = time.perf_counter()
                    self.metrics.generated_tokens.inc()
                    if last_at is None:
                        self.metrics.ttft.observe(now - submission.arrived)
                    else:
                        self.metrics.inter_token.observe(now - last_at)
                    last_at = now
                    generated.append(token)
                    text = watcher.push(token)
                    if watcher.matcher.stopped:
                        loop.stop(0)
                    reason = loop.results[0].finish_reason
                    if reason is not None:
                        text += watcher.finish()
                    submission.sink.put(Piece(submission.index, token, text, None, None,
                                              public_finish_reason(reason), cached + len(new_ids), cached,
                                              len(generated)))
                    if submission.cancelled:
                        break
        finally:
            # The cache holds the prompt and every generated token but the last (never fed); with
            # no token at all the prompt may not have been fed whole: do not keep that cache.
            if generated:
                conversation.fed = conversation.fed + new_ids + generated[:-1]
                conversation.pending = generated[-1:]
                if submission.prompt_text is not None:
                    reply = gen.tokenizer.decode(generated, skip_special_tokens=False)
                    conversation.fed_text = submission.prompt_text + reply
                self._keep(conversation)
            self.metrics.prompt_tokens.inc(cached + len(new_ids))
            self.metrics.cached_prompt_tokens.inc(cached)
