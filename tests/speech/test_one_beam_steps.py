"""A window's decode steps must take the paged decode path (the one-op decoder layers), not FastSeq's folded
attention, even when its prompt (previous text, as the long-form transcription conditions each window on)
fills whole cache blocks. Greedy: a beam group of one beam shares its prompt blocks with no other row, so
folding gains nothing; it took every layer of such a step off the one-op path (tiny.en int8 long-form,
greedy: 1,100 of 1,476 layer-steps ran the Python loop). Beam 5: Whisper's beams do not fold where the
one-op layers run (engine/beam_group.py's folds_beams; tiny.en int8 long-form, beam 5: 1,068 of 1,428
layer-steps ran the Python loop)."""

from __future__ import annotations

import pytest
import torch
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import EOT, FRAMES, MELS, NO_TIMESTAMPS, SOT, build, run_arriving, save, vocabulary

from fastdecode.engine import plan as step_plans
from fastdecode.layers import ops
from fastdecode.speech.batching import BLOCK_SIZE, answer, encode_windows, speech_engine, window_tokens
from fastdecode.speech.loading import load_whisper
from fastdecode.speech.search import SearchOptions

pytestmark = pytest.mark.skipif(not ops.available(), reason="the C++ extension is not available")

PREVIOUS_TEXT = [95, *range(5, 5 + BLOCK_SIZE + 4)]  # <|startofprev|> and 20 text tokens: a full block and more


@pytest.mark.parametrize("beam_size", [1, 5])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_window_after_previous_text_decodes_on_the_paged_path(quantize, beam_size, tmp_path, monkeypatch):
    save(build(seed=2), tmp_path)
    model = load_whisper(tmp_path, need_vocabulary=False, quantize=quantize).model
    prompt = [*PREVIOUS_TEXT, SOT, NO_TIMESTAMPS]
    options = SearchOptions(max_length=34, suppress_at_begin=(EOT,), beam_size=beam_size)
    windows = [(prompt, len(PREVIOUS_TEXT), options, 0)]
    paged, folded = [0], [0]
    operands = step_plans.StepPlan.decode_operands

    def counted(plan, layer):
        result = operands(plan, layer)
        if all(group.queries == 1 for group in plan.groups):  # a pure decode step
            (paged if result is not None else folded)[0] += 1
        return result

    monkeypatch.setattr(step_plans.StepPlan, "decode_operands", counted)
    torch.manual_seed(4)
    with torch.inference_mode():
        sources = encode_windows(model, torch.randn(1, MELS, FRAMES))
        engine = speech_engine(model, 2 * window_tokens(model, beam_size))
        sequences = run_arriving(engine, model, vocabulary(), sources, windows)
    tokens = answer(sequences[0], vocabulary()).tokens
    assert len(tokens) >= 3  # it decoded several steps after its prompt
    assert paged[0] >= 3 * model.config.num_layers and folded[0] == 0
