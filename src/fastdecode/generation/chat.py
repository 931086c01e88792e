"""Multi-turn chat over one streaming cache: each turn feeds only its new tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


from ..config import GenerationConfig
from .decode import DecodeLoop
from .stopping import TextWatcher
from .streaming import streaming_engine


class ChatSession:
    """A conversation whose tokens live in a streaming cache between turns.

    The chat template renders the whole conversation; what a new turn adds is the rendering's
    suffix past what the cache already holds, so earlier turns are never prefilled again (when
    a template rewrites earlier text, the session falls back to feeding the whole rendering).
    """

    def __init__(self, generator: Any, config: GenerationConfig, system: str | None = None):
        self.generator = generator
        self.config = config
        self.tokenizer = generator._require_tokenizer()
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.engine = streaming_engine(generator.model, config)
        self.fed_text = ""  # the rendering the cache holds (plus the pending token's text)
        self.pending: list[int] = []  # generated but not yet fed (the last token of the reply)
        self.full_rebuilds = 0

    def send(self, message: str) -> Iterator[str]:
        """Add a user message; stream the assistant's reply as text pieces."""
        from ..validation import check_text

        check_text(message, "the message")  # before the conversation changes: a bad line is skipped
        self.messages.append({"role": "user", "content": message})
        rendered = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        if rendered.startswith(self.fed_text):
            new_ids = self.pending + self.tokenizer.encode(rendered[len(self.fed_text):], add_special_tokens=False)
        else:  # the template changed earlier text: start the cache over
            self.engine = streaming_engine(self.generator.model, self.config)
            self.full_rebuilds += 1
            new_ids = self.tokenizer.encode(rendered, add_special_tokens=False)
        loop = DecodeLoop(self.generator.model, [new_ids], self.config, self.generator._eos_ids(self.config),
                          engine=self.engine)
        watcher = TextWatcher(self.tokenizer, self.config.stop_strings())
        try:
            for events in loop:
                piece = watcher.push(events[0][1])
                if piece:
                    yield piece
                if watcher.matcher.stopped:
                    loop.stop(0)
            tail = watcher.finish()
            if tail:
                yield tail
        finally:
            generated = loop.results[0].tokens
            reply = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": reply})
            # The cache holds everything but the last generated token, which the next turn feeds.
            self.fed_text = rendered + self.tokenizer.decode(generated, skip_special_tokens=False)
            self.pending = generated[-1:]


__all__ = ["ChatSession"]
