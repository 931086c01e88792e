"""Multi-turn chat: the conversation is one engine sequence kept between turns.

A turn resumes the kept sequence with the turn's new tokens (``Engine.resume``): the K/V of every
earlier turn stay in the sequence's blocks and the model runs only the new tokens (the last
reply token, which was generated but never fed, and the user's message as the template renders
it). The new tokens are found on text, as before: the chat template renders the whole
conversation and the turn adds the rendering's suffix past what the conversation holds (when a
template rewrites earlier text, the session starts over from the whole rendering).

Overflow: the session has ``n_ctx`` positions (sinks + shift or re-evaluate past them). While a
turn cannot run past ``n_ctx`` it runs as a plain kept sequence, which gives what a stream gives
before its first eviction. The first turn that could overflow (or that has no
``max_new_tokens``) switches the kept sequence to the streaming policy
(engine/stream_steps.py ``switch_to_stream``: the policy adopts the blocks it holds) and every
later turn resumes it as a stream, in the same engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from ..config import GenerationConfig
from ..engine import Engine, Sequence, TokenEvent
from ..engine.requests import RequestFactory
from ..errors import TokenizerError
from ..decoding.sampling import sequence_seeds
from ..engine.stream_steps import switch_to_stream
from ..engine.streaming_policy import check_streamable, stream_capacity


class EngineConversation:
    """A conversation in an engine of its own (room for one stream of ``n_ctx``): the kept
    sequence between turns, a plain one until it switches to the streaming policy."""

    def __init__(self, model: Any, factory: RequestFactory, config: GenerationConfig):
        self.model, self.factory = model, factory
        self.n_ctx = min(config.n_ctx, model.config.max_position_embeddings)
        self.engine = Engine(model, factory, max_queue=1, cache_tokens=stream_capacity(config))
        self.sequence: Sequence | None = None
        self.streaming = False  # switched to the streaming policy

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

    def switch_to_stream(self, config: GenerationConfig) -> None:
        """Every later turn runs under the streaming policy, on the same kept sequence."""
        if self.sequence is not None:
            switch_to_stream(self.engine, self.sequence, config)
        self.streaming = True

    def turn(self, new_ids: list[int], config: GenerationConfig) -> Iterator[TokenEvent]:
        """Feed ``new_ids`` after the conversation; the reply's events. Stopping early (closing the
        iterator) cancels the reply but keeps what it computed."""
        engine_config = dataclasses.replace(config, n_ctx=config.n_ctx if self.streaming else None, seed=None)
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
        check_streamable(model.config, config.n_ctx, config.policy)  # refused here, as before
        self.engine = self._fresh_conversation()
        self.fed_text = ""  # the rendering the conversation holds (plus the pending token's text)
        self.full_rebuilds = 0

    def _fresh_conversation(self) -> EngineConversation:
        conversation = EngineConversation(self.model, self.factory, self.config)
        if not self.config.use_cache:  # (a stream has its cache whatever use_cache says)
            conversation.switch_to_stream(self.config)
        return conversation

    def send(self, message: str) -> Iterator[str]:
        """Add a user message; stream the assistant's reply as text pieces."""
        from ..validation import check_text

        check_text(message, "the message")  # before the conversation changes: a bad line is skipped
        self.messages.append({"role": "user", "content": message})
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if rendered.startswith(self.fed_text):
            new_ids = self.tokenizer.encode(rendered[len(self.fed_text):], add_special_tokens=False)
        else:  # the template changed earlier text: start the conversation over
            self.engine.close()  # its engine stays (the prefix cache may still serve full blocks)
            if self.engine.streaming:
                self.engine = self._fresh_conversation()
            self.full_rebuilds += 1
            new_ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        if not self.engine.streaming and not self.engine.fits(new_ids, self.config):
            self.engine.switch_to_stream(self.config)
        generated: list[int] = []
        try:
            for event in self.engine.turn(new_ids, self.config):
                if event.token_id is not None:
                    generated.append(event.token_id)
                if event.text:
                    yield event.text
        finally:
            reply = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
            # The conversation holds everything but the last generated token, which the next turn feeds.
            self.fed_text = rendered + self.tokenizer.decode(generated, skip_special_tokens=False)


__all__ = ["ChatSession", "EngineConversation"]
