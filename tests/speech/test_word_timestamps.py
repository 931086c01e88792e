"""Word timestamps: the DTW, the median filter and punctuation merging on made-up inputs, and
(slow) the words and times against faster-whisper's on espeak-ng speech with Whisper tiny.en."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_whisper_real import SENTENCES, speak, tiny_en  # noqa: F401 - tiny_en: a fixture

from fastdecode.speech.alignment import WordTiming, dtw, median_filter
from fastdecode.speech.words import merge_punctuations


def test_dtw_follows_the_cheap_cells_monotonically():
    cost = np.ones((3, 6))
    for i, j in [(0, 0), (0, 1), (1, 2), (1, 3), (2, 4), (2, 5)]:
        cost[i, j] = 0.0
    rows, cols = dtw(cost)
    assert rows.tolist() == [0, 0, 1, 1, 2, 2] and cols.tolist() == [0, 1, 2, 3, 4, 5]


def test_dtw_path_is_the_cheapest_on_random_costs():
    rng = np.random.default_rng(0)
    cost = rng.random((5, 9))
    rows, cols = dtw(cost)
    assert (rows[0], cols[0], rows[-1], cols[-1]) == (0, 0, 4, 8)
    steps = set(zip(np.diff(rows).tolist(), np.diff(cols).tolist()))
    assert steps <= {(1, 1), (1, 0), (0, 1)}
    best = np.full((6, 10), np.inf)  # the cheapest total, by the textbook recurrence
    best[0, 0] = 0
    for i in range(1, 6):
        for j in range(1, 10):
            best[i, j] = cost[i - 1, j - 1] + min(best[i - 1, j - 1], best[i - 1, j], best[i, j - 1])
    assert cost[rows, cols].sum() == pytest.approx(best[5, 9])


def test_median_filter_is_a_reflect_padded_running_median():
    x = torch.randn(2, 3, 20)
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (3, 3)), mode="reflect")
    expected = np.stack([np.median(padded[..., j : j + 7], axis=-1) for j in range(20)], axis=-1)
    np.testing.assert_allclose(median_filter(x, 7).numpy(), expected, rtol=0, atol=0)


def test_punctuation_joins_its_word():
    words = [WordTiming(w, [n], n, n + 1, 1.0) for n, w in enumerate([' "', "Hello", ",", " world", "."])]
    merge_punctuations(words)
    assert [w.word for w in words] == ["", ' "Hello,', "", " world.", ""]
    assert [w.tokens for w in words] == [[], [0, 1, 2], [], [3, 4], []]


@pytest.mark.slow
def test_words_and_times_match_faster_whisper(tiny_en, tmp_path):  # noqa: F811 - the imported fixture
    faster_whisper = pytest.importorskip("faster_whisper")
    from fastdecode import load_speech

    voice, speed, _language, text = SENTENCES[0]
    audio = str(speak(tmp_path, voice, speed, text + " " + SENTENCES[1][3]))
    torch.set_num_threads(2)
    ours = [w for s in load_speech(tiny_en).transcribe(audio, language="en", word_timestamps=True).segments
            for w in s.words]
    model = faster_whisper.WhisperModel(str(tiny_en), device="cpu", compute_type="float32", cpu_threads=2)
    segments, _ = model.transcribe(audio, language="en", word_timestamps=True)
    theirs = [w for s in segments for w in s.words]
    assert [w.word for w in ours] == [w.word for w in theirs] and len(ours) > 15
    for a, b in zip(ours, theirs):
        assert abs(a.start - b.start) <= 0.021 and abs(a.end - b.end) <= 0.021, (a, b)
        assert abs(a.probability - b.probability) < 0.02, (a, b)
