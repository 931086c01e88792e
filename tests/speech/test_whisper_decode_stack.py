"""Whisper's whole decoder as ONE op per pure decode step (layers/cross_decode_stack.cpp, models/whisper_decode.py's
``every_layer``) against the per-layer op (cross_decode_block) and the Python loop, float32 and int8.

The stack op runs cross_decode_block over the layers in order with the arguments the per-layer calls get,
so it must give their bits: every call's output and the K/V it writes equal the per-layer calls' on the
same inputs (torch.equal), and the tokens, summed log-probabilities and no-speech probabilities of greedy
and beam-5 windows (with and without timestamps, several windows in a step) equal the per-layer op's and
the Python loop's, on one thread and on two."""

from __future__ import annotations

import pytest
import torch
from test_whisper_decode_block import _engine_run as engine_run
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import EOT, NO_TIMESTAMPS, SOT, build, save

from fastdecode.layers import ops
from fastdecode.speech.loading import load_whisper
from fastdecode.speech.search import SearchOptions

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")


def options(**changes) -> SearchOptions:
    return SearchOptions(max_length=28, suppress_at_begin=(EOT,), max_initial_timestamp_index=4, **changes)


# (prompt, index of <|startoftranscript|>, options, the step it arrives at): greedy and beam-5 windows, with and
# without timestamps, arriving at different steps (steps of one window and of several)
WINDOWS = [([SOT, NO_TIMESTAMPS], 0, options(beam_size=1), 0),
           ([SOT], 0, options(beam_size=5, timestamps=True), 3),
           ([SOT], 0, options(beam_size=1, timestamps=True), 5),
           ([95, 5, 6, SOT, NO_TIMESTAMPS], 3, options(beam_size=5), 5)]


@pytest.fixture(scope="module", params=[None, "int8"], ids=["float32", "int8"])
def model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    save(build(seed=11, decoder_layers=4), folder)
    return load_whisper(folder, need_vocabulary=False, quantize=request.param).model


def _engine_run(model) -> list[tuple]:
    return engine_run(model, WINDOWS, seed=12)


def _per_layer_calls(fused, x, ints, floats, keys, values, slots, table, key_start, positions, source_keys,
                     source_values, source_lengths):
    """The stack op's work as one cross_decode_block call per layer (each with its own ints and sources)."""
    layers, sources = len(keys), len(source_lengths)
    head, source_ints = ints[:5], ints[len(ints) - 3 * sources:]
    for index in range(layers):
        layer_ints = [*head, *ints[5 + 30 * index : 5 + 30 * (index + 1)], *source_ints]
        x = fused.op(x, fused.weights[index], layer_ints, floats, keys[index], values[index], slots, table, key_start,
                     positions, source_keys[index * sources : (index + 1) * sources],
                     source_values[index * sources : (index + 1) * sources], source_lengths)
    return x


def test_every_call_equals_the_per_layer_calls(model, monkeypatch):
    """Each stack call against the per-layer calls on copies of the same K/V pools: the same output and the
    same K/V written, bit for bit."""
    fused = model.fused_layers
    stack_op, checked = fused.stack_op, []

    def checking(stack, x, ints, floats, keys, values, *rest):
        copies = ([k.clone() for k in keys], [v.clone() for v in values])
        out = stack_op(stack, x, ints, floats, keys, values, *rest)
        alone = _per_layer_calls(fused, x, ints, floats, *copies, *rest)
        assert torch.equal(out, alone)
        assert all(torch.equal(a, b) for a, b in zip(keys + values, copies[0] + copies[1]))
        checked.append(len(rest[-1]))  # the windows of the step
        return out

    monkeypatch.setattr(fused, "stack_op", checking)
    _engine_run(model)
    assert len(checked) >= 20 and max(checked) >= 2 and min(checked) == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_engine_searches_equal_per_layer_ops_and_the_python_loop(model, threads, monkeypatch):
    fused = model.fused_layers
    calls = {"stack": 0, "layer": 0}
    stack_op, op = fused.stack_op, fused.op

    def counted_stack(*args):
        calls["stack"] += 1
        return stack_op(*args)

    def counted_layer(*args):
        calls["layer"] += 1
        return op(*args)

    monkeypatch.setattr(fused, "stack_op", counted_stack)
    monkeypatch.setattr(fused, "op", counted_layer)
    torch.set_num_threads(threads)
    try:
        stacked = _engine_run(model)
        assert calls["stack"] >= 20 and calls["layer"] == 0  # every pure decode step as one op
        monkeypatch.setattr(fused, "stack_op", lambda *args: None)  # the stack declines: one op per layer
        per_layer = _engine_run(model)
        assert calls["layer"] >= 20 * model.config.num_layers
        monkeypatch.setattr(model, "fused_layers", None)
        python_loop = _engine_run(model)
    finally:
        torch.set_num_threads(1)
    assert any(len(tokens) > 5 for tokens, _, _ in stacked)
    assert stacked == per_layer == python_loop
