"""The one-op decoder block (layers/decode_block.cpp, models/llama_decode.py) against the Python loop,
for int8, float32 and mixed models.

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
from fastdecode.layers.elementwise import elementwise_ops  # noqa: E402
from fastdecode.layers.products import KernelChoice  # noqa: E402
from fastdecode.models.llama_decode import FusedDecode  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from tiny_gguf import write_gguf  # noqa: E402
from tiny_models import save_tiny_folder  # noqa: E402

pytestmark = pytest.mark.skipif(elementwise_ops() is None, reason="the C++ extension is not available")

# lengths past the sliding kinds' window of 8 (mistral, qwen2-swa), so windowed tables are exercised
PROMPTS = [[5, 9, 2, 33, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [7] * 3 + list(range(60, 77))]


def _counting(fused: FusedDecode, monkeypatch) -> list[int]:
    """Counts the blocks run in C++ (a list holding one int) for the rest of the test: one per call of the
    per-block op, every block per call of the whole-stack op (decode_stack.cpp)."""
    calls, op, stack_op = [0], fused.op, fused.stack_op

    def counted(*args):
        calls[0] += 1
        return op(*args)

    def counted_stack(stack, *args):
        calls[0] += stack.blocks()
        return stack_op(stack, *args)

    monkeypatch.setattr(fused, "op", counted)
    monkeypatch.setattr(fused, "stack_op", counted_stack)
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


@pytest.fixture(scope="module", params=[(kind, "int8", 96) for kind in
                                        ("llama-gqa", "llama-mqa", "mistral", "qwen2-swa", "llama-rope-llama3")]
                + [("llama-mqa", None, 96), ("qwen2-swa", None, 96), ("llama-gqa", "int8", 112)],
                ids=lambda p: f"{p[0]}-{p[1] or 'float32'}-{p[2]}")
def kernel_gen(request, tmp_path_factory):
    """int8-quantized models of every kind, float32 ones (their products through float_matmul), and one
    whose down matrix (112 inputs, not a multiple of 32) stays float32 beside int8 products."""
    kind, quantize, intermediate = request.param
    folder = tmp_path_factory.mktemp(kind)
    save_tiny_folder(folder, kind, with_tokenizer=False, intermediate_size=intermediate)
    return fastdecode.load(str(folder), quantize=quantize)


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "temperature": 0.9, "seed": 3}], ids=["greedy", "sampled"])
def test_engine_steps_equal_the_python_loop(kernel_gen, options, monkeypatch):
    model = kernel_gen.model
    assert model.fused_decode is not None
    calls = _counting(model.fused_decode, monkeypatch)
    with_op = _engine_run(kernel_gen, options)
    assert calls[0] >= 9 * model.config.num_layers  # every pure decode step, every block
    monkeypatch.setattr(model, "fused_decode", None)
    assert with_op == _engine_run(kernel_gen, options)


def test_beam_search_equals_the_python_loop(kernel_gen, monkeypatch):
    model = kernel_gen.model
    calls = _counting(model.fused_decode, monkeypatch)
    options = {"num_beams": 3, "max_new_tokens": 8, "eos_token_id": [], "num_return_sequences": 3}
    with_op = kernel_gen.generate_ids_with_details(PROMPTS, **options)
    assert calls[0] > 0
    monkeypatch.setattr(model, "fused_decode", None)
    python = kernel_gen.generate_ids_with_details(PROMPTS, **options)
    assert [(r.tokens, r.score) for r in with_op] == [(r.tokens, r.score) for r in python]


def test_only_models_whose_products_all_have_kernels_take_the_op(tmp_path):
    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    assert fastdecode.load(str(tmp_path), quantize="int8").model.fused_decode is not None
    assert fastdecode.load(str(tmp_path)).model.fused_decode is not None  # float32: float_matmul
    gemm_only = KernelChoice(float_kernel=False)  # float products back on oneDNN's GEMM
    assert fastdecode.load(str(tmp_path), kernels=gemm_only).model.fused_decode is None
    assert fastdecode.load(str(tmp_path), quantize="int8", kernels=gemm_only).model.fused_decode is not None
    no_quantized = KernelChoice(quantized_kernels=False)  # every quantized product exact: not the op's kernels
    assert fastdecode.load(str(tmp_path), quantize="int8", kernels=no_quantized).model.fused_decode is None


def test_blocks_of_mixed_formats_take_the_op_and_equal_the_python_loop(tmp_path, monkeypatch):
    """A Q4_K_M file mixes types (Qwen2.5-Coder-1.5B: Q4_K, with a Q6_K V and down in half the blocks):
    Q/K/V are then two products (Q + K fused, V alone) and blocks differ in their products' ints. Each
    block still runs as one op, concatenating its two Q/K/V products as ``FusedProjection`` does: the
    Python loop's results bit for bit. Here Q4_0 with a Q8_0 V and down in block 0 only."""
    path = write_gguf(tmp_path / "mixed.gguf", "qwen2", QT.Q4_0,
                      qtypes={"blk.0.attn_v.weight": QT.Q8_0, "blk.0.ffn_down.weight": QT.Q8_0})
    gen = fastdecode.load(str(path))
    model = gen.model
    assert [len(layer.qkv.parts) for layer in model.layers] == [2, 1]
    assert model.fused_decode is not None and model.fused_decode.block_kinds == [0, 1]
    for options in ({}, {"do_sample": True, "temperature": 0.9, "seed": 3}):
        calls = _counting(model.fused_decode, monkeypatch)
        with_op = _engine_run(gen, options)
        assert calls[0] >= 9 * model.config.num_layers
        with monkeypatch.context() as python_loop:
            python_loop.setattr(model, "fused_decode", None)
            assert with_op == _engine_run(gen, options)


def test_every_block_as_one_op_equals_the_per_block_ops(tmp_path, monkeypatch):
    """Layers of one attention kind and window run as ONE op per step (decode_stack.cpp), bit for bit the
    per-block ops; per-layer windows (qwen2-swa here) keep the per-block op."""
    from fastdecode.models import llama_decode

    save_tiny_folder(tmp_path / "gqa", "llama-gqa", with_tokenizer=False, intermediate_size=96)
    save_tiny_folder(tmp_path / "swa", "qwen2-swa", with_tokenizer=False, intermediate_size=96)
    for kind, stacked in (("gqa", True), ("swa", False)):
        gen = fastdecode.load(str(tmp_path / kind), quantize="int8")
        fused = gen.model.fused_decode
        stack_calls, stack_op = [0], fused.stack_op

        def counted(*args):
            stack_calls[0] += 1
            return stack_op(*args)

        monkeypatch.setattr(fused, "stack_op", counted)
        for options in ({}, {"do_sample": True, "temperature": 0.9, "seed": 3}):
            with_stack = _engine_run(gen, options)
            with monkeypatch.context() as per_block:
                per_block.setattr(llama_decode._Step, "every_block", lambda *args: None)
                assert with_stack == _engine_run(gen, options)
        assert (stack_calls[0] >= 9 * 2) == stacked
