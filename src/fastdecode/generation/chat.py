"""Multi-turn chat: the conversation is one engine sequence kept between turns.

A turn resumes the kept sequence with the turn's new tokens (``Engine.resume``): the K/V of every
earlier turn stay in the sequence's blocks and the model runs only the new tokens (the last
reply token, which was generated but never fed, and the user's message as the template renders
it). The new tokens are found on text, as before: the chat template renders the whole
conversation and the turn adds the rendering's suffix past what the conversation holds (when a
template rewrites earlier text, the session starts over from the whole rendering).

Overflow: the session has ``n_ctx`` positions (sinks + shift or re-evaluate past them). While a
turn cannot run past ``n_ctx`` it runs in the engine, which gives what a streaming cache gives
before its first eviction. The first turn that could overflow (or that has no ``max_new_tokens``)
hands the conversation over to the streaming cache of generation/streaming.py: it is fed the
tokens computed so far once, and every later turn runs there, exactly as before. (The stream is a
sequence of its own slot cache, with ``n_ctx`` plus headroom slots; the engine's scheduler does
not run streams, so the hand-over stays.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from ..config import GenerationConfig
from ..engine import Engine, Sequence, TokenEvent
from ..engine.requests import RequestFactory
from ..errors import TokenizerError
from ..generation.sampling import sequence_seeds
from .decode import DecodeLoop
from .stopping import TextWatcher
from .streaming import streaming_engine


class EngineConversation:
    """A conversation in an engine of its own (``n_ctx`` slots): the kept sequence between turns."""

    def __init__(self, model: Any, factory: RequestFactory, n_ctx: int):
        self.model, self.factory = model, factory
        self.n_ctx = min(n_ctx, model.config.max_position_embeddings)
        self.engine = Engine(model, factory, max_queue=1, cache_tokens=self.n_ctx)
        self.sequence: Sequence | None = None

    @property
    def next_position(self) -> int:
        """Tokens whose K/V the conversation holds (the position of the next token fed)."""
        return 0 if self.sequence is None else self.sequence.num_computed

    @property
    def tokens_run(self) -> int:
        return self.engine.tokens_run

    def fits(self, new_ids: list[int], config: GenerationConfig) -> bool:
        """Whether a turn feeding ``new_ids`` stays within ``n_ctx`` whatever it generates."""
        held = 0 if self.sequence is None else self.sequence.num_tokens
        return config.max_new_tokens is not None and held + len(new_ids) + config.max_new_tokens <= self.n_ctx

    def turn(self, new_ids: list[int], config: GenerationConfig) -> Iterator[TokenEvent]:
        """Feed ``new_ids`` after the conversation; the reply's events. Stopping early (closing the
        iterator) cancels the reply but keeps what it computed."""
        engine_config = dataclasses.replace(config, n_ctx=None, seed=None)
        seeds = sequence_seeds(config, 1) if config.is_sampling else None
        request = self.factory.request(new_ids, engine_config, seeds and seeds[0], detokenize=True)
        if self.sequence is None:
            sequence = self.engine.add(request, keep=True)
        else:
            sequence = self.engine.resume(self.sequence, request)
        self.sequence = sequence
        try:
            while self.engine.has_work():
                yield from (event for event in self.engine.step() if event.sequence is sequence)
        finally:
            if not sequence.finished:
                sequence.cancel()
                self.engine.step()  # retires it; a kept sequence keeps its blocks

    def pending(self) -> list[int]:
        """Tokens of the conversation not fed yet (the last reply token)."""
        return [] if self.sequence is None else self.sequence.tokens(self.sequence.num_computed,
                                                                     self.sequence.num_tokens)

    def hand_over(self, config: GenerationConfig):
        """A streaming cache holding what this conversation computed (fed once); frees the engine's."""
        streaming = streaming_engine(self.model, config)
        if self.sequence is not None and self.sequence.num_computed:
            with torch.inference_mode():
                streaming.feed(torch.tensor(self.sequence.tokens(0, self.sequence.num_computed), dtype=torch.long),
                               prompt=False)  # (the rows the hand-over ran before issue 30)
        self.close()
        return streaming

    def close(self) -> None:
        if self.sequence is not None:
            self.engine.drop(self.sequence)
            self.sequence = None


class ChatSession:
    """A conversation kept between turns: in the engine, then (past ``n_ctx``) in a streaming cache."""

    def __init__(self, model: Any, factory: RequestFactory, config: GenerationConfig, system: str | None = None):
        self.model, self.factory = model, factory
        self.config = config
        self.tokenizer = factory.require_tokenizer()
        if not self.tokenizer.chat_template:  # refused here, before a first turn could fail
            raise TokenizerError("this model's tokenizer has no chat template, which a chat renders every turn "
                                 "with: load a chat model (--model), or generate from a plain prompt "
                                 "(fastdecode generate --no-chat)")
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        streaming_engine(model, config)  # refuses a policy the model cannot stream with, as before
        self.engine: Any = self._fresh_conversation()  # EngineConversation, or a streaming engine
        self.fed_text = ""  # the rendering the conversation holds (plus the pending token's text)
        self.pending: list[int] = []  # streaming cache: generated but not yet fed (the reply's last token)
        self.full_rebuilds = 0

    def _fresh_conversation(self) -> Any:
        if self.config.num_beams == 1 and self.config.use_cache:
            return EngineConversation(self.model, self.factory, self.config.n_ctx)
        return streaming_engine(self.model, self.config)

    def send(self, message: str) -> Iterator[str]:
        """Add a user message; stream the assistant's reply as text pieces."""
        from ..validation import check_text

        check_text(message, "the message")  # before the conversation changes: a bad line is skipped
        self.messages.append({"role": "user", "content": message})
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if rendered.startswith(self.fed_text):
            new_ids = self.tokenizer.encode(rendered[len(self.fed_text):], add_special_tokens=False)
        else:  # the template changed earlier text: start the conversation over
            if isinstance(self.engine, EngineConversation):
                self.engine.close()  # its engine stays (the prefix cache may still serve full blocks)
            else:
                self.engine = self._fresh_conversation()
            self.pending = []
            self.full_rebuilds += 1
            new_ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        if isinstance(self.engine, EngineConversation) and not self.engine.fits(new_ids, self.config):
            self.pending = self.engine.pending()
            self.engine = self.engine.hand_over(self.config)
        generated: list[int] = []
        try:
            if isinstance(self.engine, EngineConversation):
                for event in self.engine.turn(new_ids, self.config):
                    if event.token_id is not None:
                        generated.append(event.token_id)
                    if event.text:
                        yield event.text
            else:
                yield from self._streaming_turn(self.pending + new_ids, generated)
        finally:
            reply = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
            # The conversation holds everything but the last generated token, which the next turn feeds.
            self.fed_text = rendered + self.tokenizer.decode(generated, skip_special_tokens=False)
            self.pending = generated[-1:]

    def _streaming_turn(self, new_ids: list[int], generated: list[int]) -> Iterator[str]:
        loop = DecodeLoop(self.model, [new_ids], self.config, self.factory.eos_ids(self.config),
                          engine=self.engine, grammar=self.factory.grammar(self.config))
        watcher = TextWatcher(self.tokenizer, self.config.stop_strings())
        for events in loop:
            generated.append(events[0][1])
            piece = watcher.push(events[0][1])
            if piece:
                yield piece
            if watcher.matcher.stopped:
                loop.stop(0)
        tail = watcher.finish()
        if tail:
            yield tail


__all__ = ["ChatSession", "EngineConversation"]
