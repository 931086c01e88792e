"""Quantized execution, whole models: a tiny GGUF of each block type run natively against its dequantized
float32 path, what ``inspect`` reports, the embedded model's perplexity within 1% of float32, and the
kernels' build (the block kernels themselves: test_quantized.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT  # noqa: E402
from kquant_gguf import HIDDEN, LAYERS, write_tiny_llama  # noqa: E402
from tiny_gguf import TOKENS  # noqa: E402
from tiny_models import prefill_logits  # noqa: E402

import fastdecode  # noqa: E402
from fastdecode.layers import ops, quantized  # noqa: E402
from fastdecode.layers.quantized import QuantizedWeight  # noqa: E402

GGUF_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


# --- 2: a tiny GGUF model of each type runs natively, matching its dequantized float32 path ----------


# Whole random models through the kernel (generated rows): each product carries the activation
# rounding above (~0.3% of its RMS), and 15 products in a row (7 per layer + the LM head) compound
# it, amplified by these random weights' gains. Measured RMS logit error, relative to the logits' RMS:
# 2.9-3.1% (Q8_0, Q4_0, Q4_1, Q5_0), 4.5% (Q6_K, the largest random weights), 0.02-0.03% (Q4_K, Q5_K: tiny
# random scales). A wrong kernel gives errors of the logits' own size (~100%).
NATIVE_LOGIT_RMS_BOUND = 0.1


@pytest.mark.parametrize("qtype", GGUF_TYPES, ids=lambda q: q.name)
def test_tiny_gguf_runs_natively_and_matches_its_dequantized_path(qtype, tmp_path):
    """Prompt rows decode weights exactly (float32 summation order only: 1e-4 of the logit scale);
    generated rows take the kernel (bound above; forced here on a prompt's rows by a load with
    prompt_rows="int8"), and every greedy token of the native run is the dense model's best up to
    that error (teacher-forced)."""
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", qtype, tied=qtype == QT.Q8_0)
    native, dense = fastdecode.load(path, prompt_rows="exact"), fastdecode.load(path, quantize="dequantize")
    matrices = [w for name, w in native.checkpoint.weights.items() if name.endswith(("q.weight", "embed.weight"))]
    assert matrices and all(isinstance(w, QuantizedWeight) and w.kind == qtype.name for w in matrices)
    assert not any(isinstance(w, QuantizedWeight) for w in dense.checkpoint.weights.values())
    long_ids = torch.randint(0, len(TOKENS), (40,), generator=torch.Generator().manual_seed(4)).tolist()
    reference = prefill_logits(dense, long_ids)
    torch.testing.assert_close(prefill_logits(native, long_ids), reference,
                               atol=1e-4 * float(reference.abs().max()), rtol=0)
    ids = long_ids[:12]
    reference = prefill_logits(dense, ids)
    through_kernel = prefill_logits(fastdecode.load(path, prompt_rows="int8"), ids)
    error = (through_kernel - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt()
    print(f"{qtype.name}: kernel logits RMS error {float(error):.4f} of the logits' RMS")
    assert error < NATIVE_LOGIT_RMS_BOUND
    by_default = prefill_logits(fastdecode.load(path), ids)  # "int8-mlp": only the MLP's prompt rows rounded
    assert (by_default - reference).pow(2).mean().sqrt() / reference.pow(2).mean().sqrt() < NATIVE_LOGIT_RMS_BOUND
    generated = native.generate_ids([ids], max_new_tokens=6, eos_token_id=[])[0]
    forced = prefill_logits(dense, ids + generated)[len(ids) - 1 : -1]  # [6, V]: the dense model at each step
    chosen = forced.gather(1, torch.tensor(generated)[:, None])[:, 0]  # [6]
    slack = 2 * NATIVE_LOGIT_RMS_BOUND * reference.pow(2).mean().sqrt()
    assert (chosen >= forced.max(1).values - slack).all()


def test_inspect_reports_types_and_bytes_read_per_token(tmp_path):
    gen = fastdecode.load(write_tiny_llama(tmp_path / "q4.gguf", QT.Q4_1, tied=False))
    info = gen.inspect()
    groups = {row["group"]: row for row in info["weight_groups"]}
    assert groups["layers.*.q.weight"]["type"] == "Q4_1" and groups["layers.*.q.weight"]["tensors"] == LAYERS
    assert groups["layers.*.q.weight"]["bytes"] == LAYERS * HIDDEN * HIDDEN * 5 // 8  # 5 bits per weight
    # an untied embedding table is only looked up: one row per token is read
    assert groups["embed.weight"]["bytes_read_per_token"] == groups["embed.weight"]["bytes"] // len(TOKENS)
    assert info["weight_bytes_read_per_token"] == sum(row["bytes_read_per_token"] for row in groups.values())


# --- 3: the embedded model, natively -------------------------------------------------------------
@pytest.mark.slow
def test_embedded_model_runs_on_its_own_blocks_with_no_float_copy(smollm, smollm_path, monkeypatch):
    from fastdecode.loading.gguf_file import GGUFFile

    weights = smollm.checkpoint.weights
    file_bytes = sum(info.nbytes for info in GGUFFile(smollm_path).tensors.values())
    held = {id(getattr(w, "codes", w)): w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()
            for w in weights.values()}
    assert sum(held.values()) <= file_bytes  # resident weight bytes: the file's, no float32 copy
    floats = [name for name, w in weights.items() if isinstance(w, torch.Tensor) and w.dim() == 2]
    assert floats == []
    # decode steps take the int8 kernel, the prompt's attention products the exact kernel (64 outputs decoded
    # at a time, in cache; the MLP's the int8 one: prompt_rows="int8-mlp"): no whole matrix is ever decoded
    real_dense, decoded = quantized.dense_weight, []
    monkeypatch.setattr(quantized, "dense_weight",
                        lambda weight, work, threads: decoded.append(True) or real_dense(weight, work, threads))
    real_exact, exact = ops.exact_qmatmul, []
    monkeypatch.setattr(ops, "exact_qmatmul", lambda *args: exact.append(True) or real_exact(*args))
    ids = smollm.encode_prompt("Name three colors.", chat=True)
    answer = smollm.tokenizer.decode(smollm.generate_ids([ids], max_new_tokens=12)[0])
    assert "Red" in answer and "Blue" in answer
    assert decoded == []
    # one product per fused Q/K/V group (layers/fused.py) and o
    layer_matrices = sum(len(layer.qkv.parts) + 1 for layer in smollm.model.layers)
    assert sum(exact) == layer_matrices  # once each, in the prefill; never in the 11 decode steps


@pytest.mark.slow
def test_perplexity_of_the_seeds_native_q4_1_within_1_percent_of_float(smollm, smollm_path, smollm_float):
    """The first 4,096 seed tokens. Every product of the native run goes through the integer kernel
    (prompt chunks included: int8-rounded activations), against the dequantized float32 GEMMs."""
    from conftest import SEEDS

    paths = sorted(SEEDS.glob("*.txt"))
    if not paths:
        pytest.skip(f"no seed texts in {SEEDS}")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    ids = smollm.tokenizer.encode(text)[:4096]
    assert len(ids) == 4096
    dense_nll = np.mean(smollm_float.score(ids))  # the session's dequantized load (blocks decoded to float32)
    native_nll = np.mean(fastdecode.load(str(smollm_path), prompt_rows="int8").score(ids))
    print(f"perplexity: native {np.exp(native_nll):.4f}, dequantized float32 {np.exp(dense_nll):.4f}")
    assert abs(np.exp(native_nll) / np.exp(dense_nll) - 1) < 0.01
    assert native_nll != dense_nll  # two different computations (the kernel really ran)


# --- 5: torch.compile traces the quantized op (its fake kernel) ---------------------------------------
@pytest.mark.slow
def test_compiled_quantized_decode_step_is_one_graph_with_equal_logits(tmp_path):
    """fullgraph=True fails on any op without a fake kernel: the quantized products must trace."""
    import functools

    from fastdecode.engine.decode_step import decode_products, decode_step

    if not ops.available():
        pytest.skip("no AVX2 kernel on this machine: the PyTorch fallback traces as it is")
    gen = fastdecode.load(write_tiny_llama(tmp_path / "q4.gguf", QT.Q4_1, tied=False))
    engine = gen.engine(cache_tokens=256)
    prompts = [[5, 9, 3, 7, 11], [4, 8, 12], [6, 2, 10, 13]]
    sequences = [engine.submit(p, {"max_new_tokens": 8}) for p in prompts]
    engine.step()  # prompts read: each row now decodes one token per step
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    bound = functools.partial(decode_step, gen.model, engine.cache, engine.windows, engine.score_bias,
                              decode_products(gen.model))
    torch._dynamo.reset()  # earlier tests compiled decode_step too: start below dynamo's recompile limit
    compiled = torch.compile(bound, backend=counting_backend, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        block_table = engine.cache.block_tables([s.block_table for s in sequences], 2)  # [B, 2]
        tokens = torch.tensor([s.output_ids[-1] for s in sequences])
        positions = torch.tensor([s.num_tokens - 1 for s in sequences])
        eager_logits, _ = bound(block_table, tokens, positions)
        traced_logits, _ = compiled(block_table, tokens, positions)  # rewrites the same slots
    assert len(graphs) == 1
    torch.testing.assert_close(traced_logits, eager_logits, atol=1e-5, rtol=0)


def test_a_stale_build_lock_left_by_a_killed_build_does_not_block_the_next(tmp_path, monkeypatch):
    """torch's extension builder waits forever on a ``lock`` file a killed build left behind; the
    build runs under our own flock (released by the kernel when a process dies) and clears it."""
    from torch.utils import cpp_extension

    from fastdecode.layers import kernels

    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    directory = kernels._build_dir()
    directory.mkdir(parents=True)
    (directory / "lock").write_text("")  # what a build killed mid-way leaves

    def fake_load(name, sources, extra_cflags, build_directory, is_python_module, verbose):
        assert not (Path(build_directory) / "lock").exists()
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    assert kernels.build() == directory / "fastdecode_kernels.so"
    assert kernels.build().exists()  # built once, then found
