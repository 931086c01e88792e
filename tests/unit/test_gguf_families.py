"""Issue 34's families in GGUF form: each tiny random HF model written to .gguf the way llama.cpp's
converter writes it (tests/tiny_gguf.py: llama.cpp's architecture names and metadata keys, Q/K rows
permuted for granite and smollm3, kept for qwen3 and olmo2, Llama 3's scaling as a ``rope_freqs``
tensor), loaded back: logits within 1e-4 of transformers on the same weights, and the same tokens
as the model loaded from transformers directly. Plus the refusals of keys a family does not implement."""

from __future__ import annotations

import os

import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

import fastdecode  # noqa: E402
from fastdecode.errors import UnsupportedModelError  # noqa: E402
from tiny_gguf import gguf_tensors, hf_model, write_gguf  # noqa: E402
from tiny_models import prefill_logits  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ATOL = 1e-4
KINDS = ["llama3", "qwen3", "granite", "smollm3", "olmo2"]
EXPECTED = {  # what each file must configure: the family's knobs read from llama.cpp's keys
    "llama3": lambda c: c.family == "llama" and c.rope_scaling is None,
    "qwen3": lambda c: c.qk_norm == "head" and c.head_dim == 24,
    "granite": lambda c: [c.embedding_multiplier, c.residual_multiplier, c.logits_divisor, c.attention_scale]
    == pytest.approx([3.0, 0.4, 2.5, 0.09]),  # float32 in the file
    "smollm3": lambda c: c.nope_layers == [3],
    "olmo2": lambda c: c.family == "olmo2" and c.qk_norm == "projection",
}


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_written_by_the_gguf_package_loads_back_identical(kind, tmp_path):
    hf = hf_model(kind)
    gen = fastdecode.load(str(write_gguf(tmp_path / f"{kind}.gguf", kind)))
    assert EXPECTED[kind](gen.config), gen.config
    ids = _prompt(40, 1)  # past llama3's original context (32): the scaled frequencies matter
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]  # [T, V]
    torch.testing.assert_close(prefill_logits(gen, ids), reference, atol=ATOL, rtol=0)
    direct = fastdecode.from_hf(hf)
    prompts = [_prompt(5, 2), _prompt(13, 3)]
    assert gen.generate_ids(prompts, max_new_tokens=12) == direct.generate_ids(prompts, max_new_tokens=12)


def test_llama3_rope_freqs_keep_float32_in_a_bfloat16_load(tmp_path):
    gen = fastdecode.load(str(write_gguf(tmp_path / "llama3.gguf", "llama3")), dtype="bfloat16")
    float32 = fastdecode.load(str(tmp_path / "llama3.gguf"))
    assert gen.model.dtype == torch.bfloat16
    assert torch.equal(gen.model.rope.inv_freq, float32.model.rope.inv_freq)


def test_llama3_gguf_without_its_rope_freqs_differs(tmp_path):
    """The rope_freqs tensor is applied, not ignored: the same file without it gives other logits."""
    tensors = gguf_tensors("llama3")
    del tensors["rope_freqs.weight"]
    gen = fastdecode.load(str(write_gguf(tmp_path / "plain.gguf", "llama3", tensors=tensors)))
    ids = _prompt(40, 1)
    with torch.no_grad():
        reference = hf_model("llama3")(torch.tensor([ids])).logits[0]
    assert (prefill_logits(gen, ids) - reference).abs().max() > 1e-2


@pytest.mark.parametrize("key, value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                        ("embedding_scale", 2.0)])
def test_gguf_key_a_family_lacks_is_refused_by_name(key, value, tmp_path):
    path = write_gguf(tmp_path / "extra.gguf", "qwen3",
                      extra_metadata=lambda writer: writer.add_float32(f"qwen3.{key}", value))
    with pytest.raises(UnsupportedModelError, match=key):
        fastdecode.load(str(path))


def test_unknown_gguf_rope_scaling_type_is_refused(tmp_path):
    path = write_gguf(tmp_path / "scaled.gguf", "llama3",
                      extra_metadata=lambda writer: writer.add_string("llama.rope.scaling.type", "longrope"))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        fastdecode.load(str(path))


def test_olmo2_gguf_rotating_part_of_each_head_is_refused(tmp_path):
    """OLMo 2 rotates whole heads: a file whose rope.dimension_count is half the head size is refused, as
    a HF config's partial_rotary_factor is, not run with every head rotated whole."""
    path = write_gguf(tmp_path / "partial.gguf", "olmo2",
                      extra_metadata=lambda writer: writer.add_uint32("olmo2.rope.dimension_count", 8))
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor 0.5"):
        fastdecode.load(str(path))
