"""A float32 Whisper whose weights are float16 values (a CTranslate2 float16 checkpoint) holds its decoder's
step products and the tied logits layer in float16 (models/whisper.py's hold_in_half): the kernel widens
each weight as it loads it and prompt rows take the GEMM on the float32 values, so every result must be
the float32-held model's bit for bit: the logits of a forward, and the tokens, summed log-probabilities and
no-speech probabilities of windows searched side by side (greedy, beams, timestamps, samples), on one
thread and on two. A weight that float16 cannot hold exactly stays float32."""

from __future__ import annotations

import pytest
import torch
from test_whisper_decode_block import _engine_run
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import build, save

from fastdecode.layers import ops
from fastdecode.models import whisper
from fastdecode.speech.loading import load_whisper

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = build(seed=7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.half().float())  # every value a float16 value
        model.model.decoder.layers[1].fc2.weight[0, 0] = 1 + 2**-20  # not a float16 value: that matrix stays float32
    path = tmp_path_factory.mktemp("whisper-f16-values")
    save(model, path)
    return path


def _pair(folder, monkeypatch):
    held = load_whisper(folder, need_vocabulary=False).model
    monkeypatch.setattr(whisper, "hold_in_half", lambda config, weights, kernels: [])
    plain = load_whisper(folder, need_vocabulary=False).model
    monkeypatch.undo()
    return held, plain


def test_held_in_half_exactly_where_lossless(folder, monkeypatch):
    held, plain = _pair(folder, monkeypatch)
    layers = held.config.num_layers
    assert "lm_head.weight" in held.half_held and len(held.half_held) == 1 + 8 * layers - 1
    assert "decoder.layers.1.down.weight" not in held.half_held
    assert held.dtype == torch.float32 and held.lm_head.dtype == torch.float16 and held.embed.dtype == torch.float16
    assert held.decoder.layers[1].down.dtype == torch.float32 and held.decoder.layers[0].down.dtype == torch.float16
    assert plain.half_held == [] and plain.lm_head.dtype == torch.float32
    assert held.fused_layers is not None  # the one-op decoder layers take the float16 matrices too


def test_searches_equal_the_float32_held_model(folder, monkeypatch):
    held, plain = _pair(folder, monkeypatch)
    expected = _engine_run(plain)
    assert any(len(tokens) > 3 for tokens, _, _ in expected)
    assert _engine_run(held) == expected
    torch.set_num_threads(2)
    try:
        assert _engine_run(held) == expected
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(held, "fused_layers", None)  # the Python loop: the same
    assert _engine_run(held) == expected
