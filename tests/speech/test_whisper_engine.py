"""Whisper windows as requests of the one engine: greedy, beam 5 and sampled windows arriving at
different steps share its forwards, each giving what it gives alone, and every block comes back.

(An engine runs one model, so a Whisper engine's neighbours are other Whisper requests: windows
of other transcriptions, searched with other options.)"""

from __future__ import annotations

import pytest
import torch

from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import EOT, FRAMES, MELS, NO_TIMESTAMPS, SOT, build, run_arriving, save, vocabulary

from fastdecode.errors import InvalidOptionError
from fastdecode.speech.batching import (answer, decode_windows, encode_windows, search_request, speech_engine,
                                        window_sources, window_tokens)
from fastdecode.speech.loading import load_whisper
from fastdecode.speech.requests import Search
from fastdecode.speech.search import SearchOptions


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    save(build(seed=5), folder)
    return load_whisper(folder, need_vocabulary=False).model


def options(**changes) -> SearchOptions:
    return SearchOptions(max_length=30, suppress_at_begin=(EOT,), max_initial_timestamp_index=5, **changes)


WINDOWS = [  # (prompt, the index of <|startoftranscript|>, options, the step it arrives at)
    ([SOT, NO_TIMESTAMPS], 0, options(beam_size=1), 0),
    ([95, 7, 8, 9, SOT, NO_TIMESTAMPS], 4, options(beam_size=5), 0),
    ([SOT], 0, options(beam_size=5, timestamps=True), 2),
    ([95, 3, SOT], 2, options(beam_size=1, timestamps=True), 3),
    ([SOT, NO_TIMESTAMPS], 0, options(temperature=0.7, best_of=3, seed=11), 5),
]


def test_windows_arriving_at_different_steps_equal_each_alone(model):
    torch.manual_seed(6)
    vocab = vocabulary()
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(len(WINDOWS), MELS, FRAMES))
        alone = [decode_windows(model, vocab, window_sources(sources, b), [prompt], [sot], opts)[0]
                 for b, (prompt, sot, opts, _) in enumerate(WINDOWS)]
        engine = speech_engine(model, len(WINDOWS) * window_tokens(model, 5))
        free = engine.cache.pool.num_free
        widths = []
        sequences = run_arriving(engine, model, vocab, sources, WINDOWS, lambda e: widths.append(len(e.running)))
        got = [answer(sequences[b], vocab) for b in range(len(WINDOWS))]
    assert max(widths) >= 10  # the groups' rows did share steps (beams, samples and greedy rows)
    for b, (expected, result) in enumerate(zip(alone, got)):
        assert result.tokens == expected.tokens, b
        assert result.sum_logprob == pytest.approx(expected.sum_logprob, abs=1e-4)
        assert result.no_speech_prob == pytest.approx(expected.no_speech_prob, abs=1e-6)
    assert any(len(r.tokens) > 3 for r in got)
    assert engine.cache.pool.num_free == free  # every block back


def test_cancelled_window_frees_its_blocks(model):
    torch.manual_seed(7)
    vocab = vocabulary()
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(2, MELS, FRAMES))
        engine = speech_engine(model, 2 * window_tokens(model, 5))
        free = engine.cache.pool.num_free
        searches = [engine.add(search_request(vocab, Search(window_sources(sources, b), [SOT, NO_TIMESTAMPS], 0,
                                                             options(beam_size=5)), 120, model.device))
                    for b in range(2)]
        engine.step()
        engine.step()
        searches[0].cancel()
        while engine.has_work():
            engine.step()
    assert searches[0].finish_reason == "cancelled" and searches[1].finished
    assert engine.cache.pool.num_free == free


def test_source_must_be_one_encoded_window(model):
    vocab = vocabulary()
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(2, MELS, FRAMES))
    engine = speech_engine(model, window_tokens(model, 1))
    for wrong in (sources, torch.randn(MELS, FRAMES)):  # two windows; features not encoded
        with pytest.raises(InvalidOptionError, match="window"):
            engine.add(search_request(vocab, Search(wrong, [SOT], 0, options(beam_size=1)), 120, model.device))


def test_int8_model_keeps_cross_kv_in_float16(tmp_path):
    """A model quantized at load stores each window's cross K/V in float16 (half what a decode step
    streams); the attention computes on their float32 values: the same search as on the widened K/V."""
    import copy

    save(build(seed=5), tmp_path)
    model = load_whisper(tmp_path, need_vocabulary=False, quantize="int8").model
    torch.manual_seed(8)
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(2, MELS, FRAMES))
    assert {t.dtype for t in sources.keys + sources.values} == {torch.float16}
    widened = copy.copy(sources)
    widened.keys, widened.values = [k.float() for k in sources.keys], [v.float() for v in sources.values]
    prompts, sot_index = [[SOT, NO_TIMESTAMPS], [95, 3, SOT]], [0, 2]
    for beam_size in (1, 5):
        with torch.inference_mode():
            got = decode_windows(model, vocabulary(), sources, prompts, sot_index, options(beam_size=beam_size))
            expected = decode_windows(model, vocabulary(), widened, prompts, sot_index, options(beam_size=beam_size))
        assert [(r.tokens, r.sum_logprob) for r in got] == [(r.tokens, r.sum_logprob) for r in expected]
