"""A window's word timings onto its segments, with faster-whisper's (and openai-whisper's) rules.

Punctuation joins its neighbour word (opening marks the next, closing marks the previous); a word
longer than twice the median word (at most 0.7 s) is cut at sentence ends and after pauses; a
segment's first or last word far outside the segment's own timestamps defers to them, else the
segment takes its words' times.
"""

from __future__ import annotations

import numpy as np

from .alignment import WordTiming
from .requests import Segment, Word

PREPEND_PUNCTUATIONS = "\"'“¿([{-"
APPEND_PUNCTUATIONS = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END_MARKS = ".。!！?？"


def merge_punctuations(alignment: list[WordTiming], prepended: str = PREPEND_PUNCTUATIONS,
                       appended: str = APPEND_PUNCTUATIONS) -> None:
    """In place: a prepended mark moves into the word after it, an appended one into the word
    before it (the emptied entries stay, with no text, so the token counts still add up)."""
    i = len(alignment) - 2
    j = len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous.word.startswith(" ") and previous.word.strip() in prepended:
            following.word = previous.word + following.word
            following.tokens = previous.tokens + following.tokens
            previous.word, previous.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous.word.endswith(" ") and following.word in appended:
            previous.word = previous.word + following.word
            previous.tokens = previous.tokens + following.tokens
            following.word, following.tokens = "", []
        else:
            i = j
        j += 1


def add_words(segments: list[Segment], alignment: list[WordTiming], offset: float,
              last_speech_timestamp: float) -> float:
    """Give each of a window's ``segments`` its words (times from the window's start + ``offset``)
    and adjust its start and end -> the new last speech timestamp."""
    durations = np.array([w.end - w.start for w in alignment])
    durations = durations[durations.nonzero()]
    median_duration = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    max_duration = median_duration * 2
    if len(durations):  # long words at sentence boundaries are cut
        for i in range(1, len(alignment)):
            if alignment[i].end - alignment[i].start > max_duration:
                if alignment[i].word in SENTENCE_END_MARKS:
                    alignment[i].end = alignment[i].start + max_duration
                elif alignment[i - 1].word in SENTENCE_END_MARKS:
                    alignment[i].start = alignment[i].end - max_duration
    merge_punctuations(alignment)
    index = 0
    for segment in segments:
        saved, words = 0, []
        while index < len(alignment) and saved < len(segment.tokens):
            timing = alignment[index]
            if timing.word:
                words.append(Word(timing.word, round(offset + timing.start, 2), round(offset + timing.end, 2),
                                  round(timing.probability, 4)))
            saved += len(timing.tokens)
            index += 1
        if words:
            first, last = words[0], words[-1]
            if first.end - last_speech_timestamp > median_duration * 4 and (
                    first.end - first.start > max_duration
                    or (len(words) > 1 and words[1].end - first.start > max_duration * 2)):
                if len(words) > 1 and words[1].end - words[1].start > max_duration:
                    boundary = max(words[1].end / 2, words[1].end - max_duration)
                    first.end = words[1].start = boundary
                first.start = max(0.0, first.end - max_duration)
            if segment.start < first.end and segment.start - 0.5 > first.start:
                first.start = max(0.0, min(first.end - median_duration, segment.start))
            else:
                segment.start = first.start
            if segment.end > last.start and segment.end + 0.5 < last.end:
                last.end = max(last.start + median_duration, segment.end)
            else:
                segment.end = last.end
            last_speech_timestamp = segment.end
        segment.words = words
    return last_speech_timestamp
