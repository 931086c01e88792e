"""Whisper's one-op decoder layer (layers/decode_block.cpp's cross_decode_block, models/whisper_decode.py)
against the Python loop, float32 and int8 (with a float32 down matrix beside int8 products: 56 inputs).

The op runs the same ops with the same arguments in the same order as ``BartModel.decode``'s loop body,
so every result must be the Python loop's bit for bit: the tokens, summed log-probabilities and
no-speech probabilities of windows searched side by side in one engine (greedy, beams, timestamps,
samples; several windows in a step), on one thread and on two."""

from __future__ import annotations

import pytest
import torch
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import EOT, FRAMES, MELS, NO_TIMESTAMPS, SOT, build, run_arriving, save, vocabulary

from fastdecode.layers import ops
from fastdecode.speech.batching import answer, encode_windows, speech_engine, window_tokens
from fastdecode.speech.loading import load_whisper
from fastdecode.speech.search import SearchOptions

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")


def options(**changes) -> SearchOptions:
    return SearchOptions(max_length=28, suppress_at_begin=(EOT,), max_initial_timestamp_index=4, **changes)


# (prompt, the index of <|startoftranscript|>, options, the step it arrives at): greedy windows side by
# side (several sources in one row group), two beam groups, a sampled group, arriving at different steps
WINDOWS = [([SOT, NO_TIMESTAMPS], 0, options(beam_size=1), 0),
           ([SOT], 0, options(beam_size=1, timestamps=True), 0),
           ([95, 5, 6, SOT, NO_TIMESTAMPS], 3, options(beam_size=4), 1),
           ([SOT, NO_TIMESTAMPS], 0, options(beam_size=1), 1),
           ([SOT], 0, options(beam_size=3, timestamps=True), 4),
           ([SOT, NO_TIMESTAMPS], 0, options(temperature=0.5, best_of=2, seed=3), 6)]


@pytest.fixture(scope="module", params=[(None, 56), ("int8", 56), ("int8", 64)],
                ids=["float32", "int8-float-down", "int8"])
def model(request, tmp_path_factory):
    quantize, ffn = request.param
    folder = tmp_path_factory.mktemp("whisper")
    save(build(seed=5, decoder_ffn_dim=ffn), folder)
    return load_whisper(folder, need_vocabulary=False, quantize=quantize).model


def _engine_run(model, windows=WINDOWS, seed: int = 6) -> list[tuple]:
    """Every window's (tokens, summed log-probability, no-speech probability), windows arriving at
    different steps of one engine (``windows``: as ``WINDOWS``; ``seed``: the features')."""
    torch.manual_seed(seed)
    vocab = vocabulary()
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(len(windows), MELS, FRAMES))
        sequences = run_arriving(speech_engine(model, len(windows) * window_tokens(model, 5)), model, vocab,
                                 sources, windows)
    results = [answer(sequences[b], vocab) for b in range(len(windows))]
    return [(r.tokens, r.sum_logprob, r.no_speech_prob) for r in results]


def test_engine_steps_equal_the_python_loop(model, monkeypatch):
    fused = model.fused_layers
    assert fused is not None
    calls, sources, op, stack_op = [0], [], fused.op, fused.stack_op

    def counted(*args):
        calls[0] += 1
        sources.append(len(args[10]))  # source_keys: the windows of the step
        return op(*args)

    def counted_stack(stack, *args):  # every layer in one op (cross_decode_stack.cpp): a call per layer
        calls[0] += stack.layers()
        sources.append(len(args[-1]))  # source_lengths: the windows of the step
        return stack_op(stack, *args)

    monkeypatch.setattr(fused, "op", counted)
    monkeypatch.setattr(fused, "stack_op", counted_stack)
    with_op = _engine_run(model)
    assert calls[0] >= 10 * model.config.num_layers  # every pure decode step, every layer
    assert max(sources) >= 4  # steps with several windows side by side took the op too
    assert any(len(tokens) > 3 for tokens, _, _ in with_op)
    torch.set_num_threads(2)
    try:
        assert _engine_run(model) == with_op  # the same bits on two threads
    finally:
        torch.set_num_threads(1)
    monkeypatch.setattr(model, "fused_layers", None)
    assert _engine_run(model) == with_op

