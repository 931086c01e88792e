"""A batch-1 decode step as ONE op (decode_stack.cpp's decode_stack_logits, models/llama_decode.py's
``whole_step``): the token's embedding row, the first norm, every block and the logits layer in one call.

It runs the ops the forward runs with the same arguments, so an engine run's tokens and log-probabilities
(top 3 of each step, greedy and sampled) must be those of the per-block ops and of the Python loop, bit
for bit, on quantized files like the embedded model (Q4_1 blocks, a Q8_0 table that is also the logits
layer) and others (Q4_0 with Q/K/V biases, an untied logits layer). Also: the single-position rotation
tables a ``RotaryEmbedding`` keeps are the computed ones, alone or in a batch.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as QT
from tiny_gguf import write_gguf

import fastdecode
from fastdecode.layers.elementwise import elementwise_ops
from fastdecode.layers.positions import RotaryEmbedding, rope_inverse_frequencies
from fastdecode.models import llama_decode

pytestmark = pytest.mark.skipif(elementwise_ops() is None, reason="the C++ extension is not available")

PROMPT = [5, 9, 2, 33, 7, 40, 41]
SAMPLED = {"do_sample": True, "temperature": 0.9, "seed": 3}


def _run(gen, options: dict) -> list[tuple]:
    """(token, logprob, top logprobs) of each step of one prompt, alone in its engine (batch 1)."""
    engine = gen.engine()
    engine.submit(PROMPT, {"max_new_tokens": 12, "eos_token_id": [], "logprobs": 3, **options})
    events = []
    while engine.has_work():
        events += [(e.token_id, e.logprob, tuple(e.top_logprobs)) for e in engine.step() if e.token_id is not None]
    return events


@pytest.fixture(scope="module", params=[("llama-tied", QT.Q4_1, {"token_embd.weight": QT.Q8_0}),
                                        ("qwen2", QT.Q4_0, {}), ("llama-gqa", QT.Q8_0, {})],
                ids=lambda p: f"{p[0]}-{p[1].name}")
def gguf_gen(request, tmp_path_factory):
    kind, qtype, qtypes = request.param
    path = write_gguf(tmp_path_factory.mktemp(kind) / "model.gguf", kind, qtype, qtypes=qtypes)
    return fastdecode.load(str(path))


@pytest.mark.parametrize("options", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_the_whole_step_equals_the_per_block_ops_and_the_python_loop(gguf_gen, options, monkeypatch):
    model = gguf_gen.model
    assert model.fused_decode is not None and model.fused_decode.head is not None
    calls, op = [0], llama_decode.ops.decode_stack_logits

    def counted(*args):
        calls[0] += 1
        return op(*args)

    monkeypatch.setattr(llama_decode.ops, "decode_stack_logits", counted)
    whole = _run(gguf_gen, options)
    assert calls[0] == 11  # every step after the prompt's
    with monkeypatch.context() as per_block:
        per_block.setattr(llama_decode.FusedDecode, "whole_step", lambda *args: None)
        assert _run(gguf_gen, options) == whole
    monkeypatch.setattr(model, "fused_decode", None)
    assert _run(gguf_gen, options) == whole
    assert calls[0] == 11


def test_batched_rows_and_tied_float_tables_keep_their_paths(gguf_gen, tmp_path):
    """Two rows in a step run the per-block ops and the logits layer in Python (the same bits: a row's
    result never depends on its batch); a float32 table or logits layer has no whole step."""
    alone = gguf_gen.generate_ids([PROMPT], max_new_tokens=6, eos_token_id=[])
    assert gguf_gen.generate_ids([PROMPT, PROMPT[:3]], max_new_tokens=6, eos_token_id=[])[0] == alone[0]
    float_file = write_gguf(tmp_path / "f32.gguf", "llama-tied", QT.Q8_0, qtypes={"token_embd.weight": QT.F32})
    fused = fastdecode.load(str(float_file)).model.fused_decode
    assert fused is not None and fused.head is None


def test_kept_single_position_tables_are_the_computed_ones():
    inverse, factor = rope_inverse_frequencies(64, 100000.0, {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 2048}, 8192)
    rope = RotaryEmbedding(64, inverse, factor)
    every = rope.tables(torch.arange(5000)[None], torch.float32)  # [1, 5000, 1, 64] each, computed in one batch
    for position in (0, 1, 31, 2047, 4999):
        one = torch.tensor([[position]])
        kept = rope.tables(one, torch.float32)
        assert rope.tables(one, torch.float32) is kept  # kept, not recomputed
        for table, computed, batched in zip(kept, rope._tables(one, torch.float32), every):
            assert torch.equal(table, computed) and torch.equal(table[0, 0], batched[0, position])
