"""A transcription as text, SubRip (.srt), WebVTT (.vtt) or JSON (OpenAI's ``json`` and
``verbose_json`` shapes): what the CLI writes and the server answers."""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidOptionError
from .transcribe import Transcription

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def _clock(seconds: float, decimal: str) -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def to_srt(result: Transcription) -> str:
    return "".join(f"{n}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for n, s in enumerate(result.segments, start=1))


def to_vtt(result: Transcription) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in result.segments)


def verbose(result: Transcription) -> dict[str, Any]:
    """OpenAI's ``verbose_json``: task, language, duration, text and the segments (and, from a
    transcription with word timestamps, ``words``: each word's text, start and end)."""
    answer = {"task": result.task, "language": result.language, "duration": round(result.duration, 3),
              "text": result.text,
              "segments": [{"id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                            "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                            "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob}
                           for s in result.segments]}
    if any(s.words is not None for s in result.segments):
        answer["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                           for s in result.segments for w in s.words or []]
    return answer


def render(result: Transcription, response_format: str) -> str:
    if response_format == "text":
        return result.text + "\n"
    if response_format == "srt":
        return to_srt(result)
    if response_format == "vtt":
        return to_vtt(result)
    if response_format == "json":
        return json.dumps({"text": result.text}, ensure_ascii=False)
    if response_format == "verbose_json":
        return json.dumps(verbose(result), ensure_ascii=False)
    raise InvalidOptionError(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}")
