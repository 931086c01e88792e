"""Streaming detokenization: a growing list of token ids -> text pieces, on ``DecodeStream``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from .cache import DeferredBackend

if TYPE_CHECKING:
    from .core import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces for streaming.

    Byte-level and byte-fallback tokens can split one character over several tokens, and some
    decoders depend on neighbours (SentencePiece drops the space of the *first* token only), so a
    token cannot be decoded alone. ``tokenizers.decoders.DecodeStream`` does the work (vLLM's
    ``detokenize_incrementally`` scheme, in Rust): it decodes a short window of the last tokens,
    emits the text they add once it no longer ends in U+FFFD (an incomplete UTF-8 sequence), and
    slides the window forward, so each step costs a decode of a few tokens, not of the history.

    Kept here, for what ``DecodeStream`` does not do:

    * ``finish()``: a stream that ends inside a character never yields its held-back tokens, and
      ``DecodeStream`` has no flush; the tokens pushed since the last piece are remembered here
      and decoded once, after the last piece's tokens as context.
    * A window whose text no longer starts with the text already emitted (the ByteFallback case
      below) is an error in ``DecodeStream``; here that step is decoded the same way as
      ``finish()`` and the stream restarts after it, instead of failing the generation.
    * Skipped special tokens never enter the stream: they decode to nothing, and a window that
      starts at one would hide the real first token from SentencePiece's space strip.
    * ``prompt_ids``: the prompt's last tokens (specials left out, as above) prefill the window.

    Without ``prompt_ids`` the pieces concatenate to exactly ``tokenizer.decode(pushed_ids)``
    (after ``finish()``). With ``prompt_ids`` the prompt's last tokens are context, so the pieces
    are the continuation as it reads after the prompt (e.g. a SentencePiece model's first
    generated word keeps its leading space); for byte-level BPE that is the same string.

    One case cannot be streamed exactly: ``tokenizers``' ByteFallback decoder turns a run of
    ``<0xNN>`` tokens that is not valid UTF-8 into one U+FFFD *per token*, retroactively, so a
    valid byte already emitted (say ``<0x39>`` = "9") becomes U+FFFD in ``decode(all)`` once an
    invalid byte follows it. Text the tokenizer itself produced never contains such runs, and
    byte-level BPE (GPT-2 style) decodes every sequence locally, so the stream is exact there.
    """

    _CONTEXT_TOKENS = 5  # prompt tokens kept as left context (vLLM uses the same number)

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        backend = tokenizer.backend  # DecodeStream steps only on the Rust tokenizer itself, not the cache's stand-in
        self._backend = backend.resolve() if isinstance(backend, DeferredBackend) else backend
        self._skip_special = skip_special_tokens
        self._hidden = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context = [i for i in map(int, prompt_ids) if i not in self._hidden][-self._CONTEXT_TOKENS :]
        while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith("\ufffd"):
            context.pop()  # DecodeStream would emit a context that ends in half a character as new text
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)
        self._emitted = context  # the last tokens whose text is out: finish()'s left context
        self._held: list[int] = []  # tokens pushed since the last piece
        self.text = ""

    def _piece(self, piece: str) -> str:
        self._emitted = (self._emitted + self._held)[-self._CONTEXT_TOKENS :]
        self._held = []
        self.text += piece
        return piece

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ('' while held back)."""
        token_id = int(token_id)
        if token_id in self._hidden:
            return ""
        self._held.append(token_id)
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # DecodeStream's InvalidPrefix: the ByteFallback case of the class docstring
            return self._flush()
        return "" if piece is None else self._piece(piece)

    def finish(self) -> str:
        """Flush whatever is held back (an incomplete character at the end decodes as U+FFFD)."""
        return self._flush() if self._held else ""

    def _flush(self) -> str:
        """Decode the held tokens after the emitted context here, and restart the stream after them."""
        decode = self._tokenizer.decode
        before = decode(self._emitted, skip_special_tokens=self._skip_special) if self._emitted else ""
        after = decode(self._emitted + self._held, skip_special_tokens=self._skip_special)
        piece = after[len(before) :]
        if after.endswith("\ufffd"):  # a stream cannot start after half a character: go on after the text before
            self._held = []
        self._stream = DecodeStream(ids=(self._emitted + self._held) or None, skip_special_tokens=self._skip_special)
        return self._piece(piece)
