"""Fused Q/K/V and gate/up products (layers/fused.py): same logits as separate products, one copy of
every weight in memory, quantized rows concatenated exactly."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.cache.view import NoCache
from fastdecode.layers.fused import concat_outputs, fuse_projections
from fastdecode.layers.linear import linear
from fastdecode.layers.products import KernelChoice, Products
from fastdecode.layers.quantized import QuantizedWeight, quantize_matrix
from tiny_models import VOCAB, build, build_gemma3


def generated_rows() -> Products:
    """Every row generated, on this thread's thread count."""
    return Products.generated(torch.get_num_threads(), kernels=KernelChoice())

pytest.importorskip("transformers")


def _built(kind: str):
    return build_gemma3() if kind == "gemma3" else build(kind)


def _logits(gen, ids: list[int]) -> torch.Tensor:
    """All positions' logits [T, V] of one forward without a cache."""
    with torch.inference_mode():
        return gen.model.forward(torch.tensor([ids]), torch.arange(len(ids))[None],
                                 NoCache.of_model(gen.model, generated_rows(), None, torch.arange(len(ids))[None]),
                                 all_logits=True)[0]


@pytest.mark.parametrize("kind", ["llama-mqa", "llama-gqa", "gemma3"])
def test_fused_products_match_separate_ones_and_hold_one_copy(kind, tmp_path):
    hf = _built(kind)
    hf.save_pretrained(tmp_path)
    fused = fastdecode.load(str(tmp_path))  # loader-owned buffers: fused
    separate = fastdecode.from_hf(hf)  # weights shared with transformers: never copied, so not fused
    for layer in fused.model.layers:
        assert len(layer.qkv.parts) == 1 and len(layer.gate_up.parts) == 1
    assert len(separate.model.layers[0].qkv.parts) == 3 and len(separate.model.layers[0].gate_up.parts) == 2
    ids = torch.randint(2, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    torch.testing.assert_close(_logits(fused, ids), _logits(separate, ids), atol=1e-5, rtol=0)
    assert fused.generate_ids([ids], max_new_tokens=8) == separate.generate_ids([ids], max_new_tokens=8)

    # one copy: the checkpoint's q/k/v (gate/up) entries are views of the fused matrix, and the bytes
    # held by all distinct storages are the parameters' bytes
    weights = fused.checkpoint.weights
    qkv = fused.model.layers[0].qkv.parts[0][0]
    for name in ("q", "k", "v"):
        assert weights[f"layers.0.{name}.weight"].untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in weights.values()}
    parameters = sum(p.numel() * p.element_size() for p in hf.parameters())
    assert sum(storages.values()) == parameters


def test_quantized_rows_concatenate_exactly():
    """Each output row of a fused quantized product is the same kernel dot product as alone."""
    torch.manual_seed(0)
    for kind in ("int8", "int4"):
        parts = [quantize_matrix(torch.randn(rows, 64), kind).t() for rows in (32, 16, 16)]  # [in, out] views
        fused, views = concat_outputs(parts)
        assert isinstance(fused, QuantizedWeight) and fused.shape == (64, 64)
        for part, view in zip(parts, views):
            assert view.shape == part.shape and torch.equal(view.codes, part.codes)
            assert view.codes.untyped_storage().data_ptr() == fused.codes.untyped_storage().data_ptr()
        x = torch.randn(3, 64)
        expected = torch.cat([linear(x, part.t(), products=generated_rows()) for part in parts], dim=-1)
        assert torch.equal(linear(x, fused.t(), products=generated_rows()), expected)


def test_quantized_model_fuses_only_matching_formats(tmp_path):
    build("llama-gqa").save_pretrained(tmp_path)
    gen = fastdecode.load(str(tmp_path), quantize="int8")
    layer = gen.model.layers[0]
    assert len(layer.qkv.parts) == 1 and isinstance(layer.qkv.parts[0][0], QuantizedWeight)
    weights = gen.checkpoint.weights
    assert weights["layers.0.q.weight"].kind == "int8"  # each projection still listed under its name
    assert weights["layers.0.k.weight"].codes.untyped_storage().data_ptr() == \
        layer.qkv.parts[0][0].codes.untyped_storage().data_ptr()
    groups = {row["group"]: row for row in gen.inspect()["weight_groups"]}  # views of one storage count apart
    for name in ("q", "k", "v", "gate", "up"):
        row = groups[f"layers.*.{name}.weight"]
        assert row["tensors"] == gen.config.num_layers and row["bytes"] == gen.config.num_layers * weights[
            f"layers.0.{name}.weight"].nbytes
    # a V of another format runs as its own product
    weights = dict(weights)
    C, kv = weights["layers.0.v.weight"].shape  # [in, out]
    weights["layers.0.v.weight"] = quantize_matrix(torch.randn(kv, C), "int4").t()
    projection = fuse_projections(weights, ["layers.0.q", "layers.0.k", "layers.0.v"])
    assert [weight.kind for weight, _ in projection.parts] == ["int8", "int4"]
    q, k, v = projection.split(torch.randn(2, C), generated_rows())
    assert (q.shape[-1], k.shape[-1], v.shape[-1]) == projection.sizes and v.shape[-1] == kv
