"""The temperature fallback and segment splitting of a window, driven with made-up results."""

from __future__ import annotations

from types import SimpleNamespace

from fastdecode.speech.requests import Search
from fastdecode.speech.search import WindowResult
from fastdecode.speech.transcribe import TranscribeOptions, Transcriber

BEGIN = 1000  # the made-up vocabulary's first timestamp token


def transcriber() -> Transcriber:
    """Token i decodes to word i; ids from 1000 are timestamps (0.02 s each)."""
    vocabulary = SimpleNamespace(decode=lambda ids: "".join(f" w{i}" for i in ids if i < 999), eot=999,
                                 timestamp_begin=BEGIN)
    checkpoint = SimpleNamespace(model=None, vocabulary=vocabulary, suppress_tokens=[], suppress_at_begin=[],
                                 config=SimpleNamespace(max_target_positions=448))
    return Transcriber(checkpoint)


def drive(results: list[WindowResult]):
    """Answer the fallback's searches with ``results`` in turn -> (temperatures asked, the choice)."""
    steps = transcriber()._decode_with_fallback("sources", [1, 2], 0, TranscribeOptions())
    asked, request = [], next(steps)
    try:
        for result in results:
            assert isinstance(request, Search)
            asked.append(request.options.temperature)
            request = steps.send(result)
    except StopIteration as stop:
        return asked, stop.value
    raise AssertionError("the fallback asked for more searches than given")


def test_a_good_first_result_is_kept():
    asked, (result, temperature) = drive([WindowResult([1, 2, 3], -0.5)])
    assert asked == [0.0] and temperature == 0.0 and result.tokens == [1, 2, 3]


def test_repetitive_then_unlikely_results_fall_back_to_higher_temperatures():
    repetitive = WindowResult([7] * 60, -0.1)  # " w7" sixty times: compresses far better than 2.4
    unlikely = WindowResult([1, 2, 3], -5.0)  # average log-probability -1.25 < -1
    fine = WindowResult([4, 5], -0.3)
    asked, (result, temperature) = drive([repetitive, unlikely, fine])
    assert asked == [0.0, 0.2, 0.4] and temperature == 0.4 and result is fine


def test_when_every_temperature_fails_the_most_likely_not_repetitive_result_wins():
    results = [WindowResult([7] * 60, -0.1)] + [WindowResult([1, 2, 3], -5.0 - n) for n in range(5)]
    asked, (result, temperature) = drive(results)
    assert asked == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert temperature == 0.2 and result is results[1]  # the repetitive one is passed over despite its score


def test_silence_is_accepted_without_fallback():
    silent = WindowResult([1], -3.0, no_speech_prob=0.9)
    asked, (result, _) = drive([silent])
    assert asked == [0.0] and result is silent


def test_segments_split_at_timestamp_pairs_and_seek_to_the_last_closed_one():
    t = transcriber()
    # <0.00> w1 w2 <1.00> <1.00> w3 <2.00> <2.50> w4 (unclosed: decoded again from the next window)
    tokens = [BEGIN, 1, 2, BEGIN + 50, BEGIN + 50, 3, BEGIN + 100, BEGIN + 125, 4]
    segments, advance, consumed = t._segments(WindowResult(tokens, -1.0), seek=300, window_frames=3000,
                                              temperature=0.0, first_id=0)
    assert [(s.start, s.end, s.text) for s in segments] == [(3.0, 4.0, " w1 w2"), (4.0, 5.0, " w3")]
    assert advance == 200 and consumed == tokens[:7]  # 2.00 s = 200 frames
    # ending on a lone timestamp: the whole window is consumed
    segments, advance, consumed = t._segments(WindowResult([BEGIN, 1, BEGIN + 40], -1.0), seek=0,
                                              window_frames=1234, temperature=0.0, first_id=5)
    assert [(s.id, s.start, s.end) for s in segments] == [(5, 0.0, 0.8)] and advance == 1234
