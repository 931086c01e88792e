"""Stop strings over streamed text: emit what is safe, hold back a possible stop-string prefix."""

from __future__ import annotations

from typing import Any


class StopStringMatcher:
    """Feed text pieces; get back the part that can be shown, and whether a stop string ended it.

    Text that could be the beginning of a stop string is held back until it is decided, so a
    stream never shows (and later has to retract) part of a stop string.
    """

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""  # everything received
        self.emitted = 0  # chars of ``text`` handed out
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        self.text += piece
        longest = max(len(s) for s in self.stops)
        search_from = max(0, self.emitted - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit_until(min(hits))
        return self._emit_until(len(self.text) - self._pending_prefix_length())

    def finish(self) -> str:
        """End of generation: whatever was held back is not a stop string after all."""
        return "" if self.stopped else self._emit_until(len(self.text))

    def _pending_prefix_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:size]):
                    best = size
                    break
        return best

    def _emit_until(self, end: int) -> str:
        end = max(end, self.emitted)
        piece = self.text[self.emitted : end]
        self.emitted = end
        return piece

    @property
    def output(self) -> str:
        return self.text[: self.emitted]


class TextWatcher:
    """Incremental detokenization plus stop-string matching for one sequence.

    ``push(token)`` returns the text that can be shown now (a possible stop-string prefix held
    back); ``matcher.stopped`` turns True once a stop string completed.
    """

    def __init__(self, tokenizer, stops: list[str]):
        from ..loading.tokenizer import IncrementalDetokenizer

        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopStringMatcher(stops) if stops else _PassThrough()

    def push(self, token: int) -> str:
        return self.matcher.feed(self.detokenizer.push(token))

    def finish(self) -> str:
        return self.matcher.feed(self.detokenizer.finish()) + self.matcher.finish()


class _PassThrough:
    stopped = False

    def feed(self, piece: str) -> str:
        return piece

    def finish(self) -> str:
        return ""


def final_text(tokenizer: Any, tokens: list[int], stops: list[str]) -> str:
    """A finished sequence's text (special tokens skipped), cut before the first stop string."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    if not stops:
        return text
    matcher = StopStringMatcher(stops)
    matcher.feed(text)
    matcher.finish()
    return matcher.output
