"""Conversations longer than the context: streams of the one engine, kept between requests.

With ``--n-ctx`` and ``--context-overflow shift|reevaluate``, a request that would pass the
context is an ordinary engine submission with the streaming options (``n_ctx``, ``n_keep``,
``policy``): its sequence carries the streaming policy (engine/streaming_policy.py) and runs in
the same steps as every other request. The server is stateless (each request carries the whole
conversation), so a finished stream is kept (``keep=True``: its blocks stay) and a later request
that continues it resumes it (``Engine.resume``): the model runs only the new tokens, however
long the conversation has grown (llama.cpp's ``cache_prompt`` with context shift). A stream's
positions are shifted, so the prefix cache cannot serve it; this is its prefix cache.

Text prompts (chat renderings, completion strings) are matched on text, as ChatSession does: a
reply re-tokenized inside the next turn's rendering need not give the tokens that were
generated, but its text is the same. Token prompts are matched on tokens. Everything here runs
on the engine's thread.
"""

from __future__ import annotations

from typing import Any


class _Kept:
    def __init__(self, sequence: Any, text: str | None):
        self.sequence = sequence  # a finished kept stream: it holds every token but its last one
        self.text = text  # the text it holds (prompt text + generated tokens), when the prompt had one


class KeptStreams:
    """``streaming``: the n_ctx / n_keep / policy options of conversations past the context."""

    def __init__(self, generator: Any, streaming: dict[str, Any], max_conversations: int = 4):
        self.generator = generator
        self.streaming = streaming
        self.max_conversations = max_conversations
        self._kept: list[_Kept] = []  # least recently used first

    def options(self, options: dict[str, Any]) -> dict[str, Any]:
        return {**options, **self.streaming}

    def submit(self, engine: Any, prompt: list[int], text: str | None, options: dict[str, Any]) -> Any:
        """The request's sequence: the kept stream it continues, resumed with its new tokens, or a
        fresh stream (kept when it ends)."""
        options = self.options(options)
        for kept in reversed(self._kept):
            new = self._continuation(kept, prompt, text)
            if new is not None:
                self._kept.remove(kept)
                return engine.resume(kept.sequence, self.generator.requests.build(new, options))
        return engine.submit(prompt, options, keep=True)

    def _continuation(self, kept: _Kept, prompt: list[int], text: str | None) -> list[int] | None:
        """The tokens ``prompt`` adds after what ``kept`` holds (its unfed last token is fed by the
        resume), or None when it does not continue it."""
        if text is not None and kept.text is not None:
            if len(text) > len(kept.text) and text.startswith(kept.text):
                return self.generator.tokenizer.encode(text[len(kept.text):], add_special_tokens=False)
            return None
        held = kept.sequence.tokens(0, kept.sequence.num_tokens)
        if len(held) < len(prompt) and prompt[: len(held)] == held:
            return prompt[len(held):]
        return None

    def finished(self, engine: Any, sequence: Any, text: str | None) -> None:
        """Keep a finished stream for the next request of its conversation (one that generated
        nothing may not have fed its whole prompt: it is dropped)."""
        if not sequence.output_ids:
            engine.drop(sequence)
            return
        if text is not None:
            text += self.generator.tokenizer.decode(sequence.output_ids, skip_special_tokens=False)
        self._kept.append(_Kept(sequence, text))
        for old in self._kept[: -self.max_conversations]:
            engine.drop(old.sequence)
        del self._kept[: -self.max_conversations]

    def make_room(self, engine: Any) -> None:
        """After a step: requests still wait and nothing runs (the step could admit none of them),
        so the kept streams' blocks are what they wait for: the least recently used one goes."""
        if self._kept and engine.waiting and not engine.running:
            engine.drop(self._kept.pop(0).sequence)

    def forget(self) -> None:
        """The engine was replaced (after a failed step): its kept streams are gone with it."""
        self._kept = []
