"""The one-op decoder block (layers/decode_block.cpp, models/llama_decode.py) against the Python loop.

The op runs the same kernels with the same arguments in the same order as ``LlamaModel.forward``'s
loop body, so every result must be the Python loop's bit for bit: the tokens and the log-probabilities
(top 3 of each step) of an engine run, greedy and sampled, beam search, per attention kind (GQA, MQA
with biases, a sliding window on every layer, per-layer windows, RoPE scaling).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import fastdecode  # noqa: E402
from fastdecode.layers.kernels import elementwise_ops  # noqa: E402
from fastdecode.models.llama_decode import FusedDecode  # noqa: E402
from tiny_models import save_tiny_folder  # noqa: E402

pytestmark = pytest.mark.skipif(elementwise_ops() is None, reason="the C++ extension is not available")

# lengths past the sliding kinds' window of 8 (mistral, qwen2-swa), so windowed tables are exercised
PROMPTS = [[5, 9, 2, 33, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7] * 3 + list(range(60, 77))]


def _counting(fused: FusedDecode, monkeypatch) -> list[int]:
    """Counts the op's calls (a list holding one int) for the rest of the test."""
    calls, op = [0], fused.op

    def counted(*args):
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(fused, "op", counted)
    return calls


def _engine_run(gen, options: dict) -> list[list[tuple]]:
    """Each prompt's (token, logprob, top logprobs) per step, all prompts in one engine."""
    engine = gen.engine()
    sequences = [engine.submit(p, {"max_new_tokens": 10, "eos_token_id": [], "logprobs": 3, **options})
                 for p in PROMPTS]
    events = {s.id: [] for s in sequences}
    while engine.has_work():
        for event in engine.step():
            if event.token_id is not None:
                events[event.sequence.id].append((event.token_id, event.logprob, tuple(event.top_logprobs)))
    return [events[s.id] for s in sequences]


@pytest.fixture(scope="module", params=["llama-gqa", "llama-mqa", "mistral", "qwen2-swa", "llama-rope-llama3"])
def int8_gen(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    save_tiny_folder(folder, request.param, with_tokenizer=False, intermediate_size=96)  # every K a multiple of 32
    return fastdecode.load(str(folder), quantize="int8")


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "temperature": 0.9, "seed": 3}], ids=["greedy", "sampled"])
def test_engine_steps_equal_the_python_loop(int8_gen, options, monkeypatch):
    model = int8_gen.model
    assert model.fused_decode is not None
    calls = _counting(model.fused_decode, monkeypatch)
    with_op = _engine_run(int8_gen, options)
    assert calls[0] >= 9 * model.config.num_layers  # every pure decode step, every block
    monkeypatch.setattr(model, "fused_decode", None)
    assert with_op == _engine_run(int8_gen, options)


def test_beam_search_equals_the_python_loop(int8_gen, monkeypatch):
    model = int8_gen.model
    calls = _counting(model.fused_decode, monkeypatch)
    options = {"num_beams": 3, "max_new_tokens": 8, "eos_token_id": [], "num_return_sequences": 3}
    with_op = int8_gen.generate_ids_with_details(PROMPTS, **options)
    assert calls[0] > 0
    monkeypatch.setattr(model, "fused_decode", None)
    python = int8_gen.generate_ids_with_details(PROMPTS, **options)
    assert [(r.tokens, r.score) for r in with_op] == [(r.tokens, r.score) for r in python]


def test_only_quantized_kernel_models_take_the_op(tmp_path):
    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    assert fastdecode.load(str(tmp_path)).model.fused_decode is None  # float weights: the Python loop
    assert fastdecode.load(str(tmp_path), quantize="int8").model.fused_decode is not None
