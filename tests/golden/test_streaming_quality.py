"""StreamingLLM on real weights: with attention sinks a small streaming cache stays close to the
full-context loss; the same window without sinks is clearly worse."""

from __future__ import annotations

import glob

import pytest

pytestmark = pytest.mark.slow
TOKENS = 1024


@pytest.fixture(scope="module")
def seed_ids(smollm):
    from conftest import SEEDS

    paths = sorted(glob.glob(str(SEEDS / "*.txt")))
    if not paths:
        pytest.skip(f"no seed texts in {SEEDS}")
    text = "\n\n".join(open(p, encoding="utf-8").read() for p in paths)
    return smollm.tokenizer.encode(text)[:TOKENS]


def _mean(values):
    return sum(values) / len(values)


def test_sinks_keep_the_streaming_loss_close_to_full_context(smollm, seed_ids):
    full = _mean(smollm.score(seed_ids))
    with_sinks = _mean(smollm.score(seed_ids, n_ctx=256, n_keep=4, policy="shift"))
    without_sinks = _mean(smollm.score(seed_ids, n_ctx=256, n_keep=0, policy="shift"))
    # Measured on this slice (shift, true ring n_discard=1): full 2.125, sinks 2.353 (1.107x),
    # no sinks 2.908 (1.369x); the 26k-token figures come from benchmarks/streaming_speed.py.
    assert with_sinks < 1.15 * full
    assert without_sinks > 1.25 * full
    assert without_sinks > with_sinks + 0.3
