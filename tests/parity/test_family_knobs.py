"""The special knobs of Phi-3 and Gemma 2 at non-default values, against transformers (fp32), and the
refusals where a knob cannot be run exactly. The families' common strategies (greedy, beam, batched,
cached vs naive, streaming, GGUF) run in the shared matrices: test_decoder_parity.py,
test_beam_parity.py, test_streaming_matrix.py, test_gguf_loading.py."""

from __future__ import annotations

import math

import pytest
import torch

import fastdecode
from fastdecode.errors import InvalidOptionError, PromptTooLongError, UnsupportedModelError
from fastdecode.layers.positions import rope_inverse_frequencies
from tiny_models import PHI3_LONG_FACTORS, VOCAB, build, build_phi3, prefill_logits

pytest.importorskip("transformers")

ATOL = 1e-4
SWITCH = 64  # original_max_position_embeddings of the tiny LongRoPE Phi-3


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed), device="cpu").tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


@pytest.fixture(scope="module")
def longrope():
    hf = build("phi3-longrope")
    return hf, fastdecode.from_hf(hf)


def test_longrope_short_factors_match_transformers_up_to_the_switch(longrope):
    hf, gen = longrope
    assert gen.config.max_position_embeddings == SWITCH  # the context is capped at the switch
    assert gen.model.rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(4.0)).item()
                                                             / torch.log(torch.tensor(64.0)).item()) ** 0.5)
    ids = _prompt(SWITCH, 1)
    torch.testing.assert_close(prefill_logits(gen, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_past_the_switch_transformers_changes_every_position_so_it_is_refused(longrope):
    """One token past the switch, transformers rotates every token with the long factors (its cache is
    recomputed): the logits at positions already generated change. A cached engine cannot follow,
    so fastdecode refuses a request that would cross (or start past) the switch, naming the context."""
    hf, gen = longrope
    ids = _prompt(SWITCH + 1, 2)
    before, after = _hf_logits(hf, ids[:SWITCH]), _hf_logits(hf, ids)[:SWITCH]
    assert (before - after).abs().max() > 1e-2
    with pytest.raises(PromptTooLongError, match=f"context is {SWITCH}"):
        gen.generate_ids([ids[:SWITCH - 2]], max_new_tokens=4)
    with pytest.raises(PromptTooLongError, match=f"context is {SWITCH}"):
        gen.generate_ids([ids], max_new_tokens=1)
    assert len(gen.generate_ids([ids[:SWITCH - 4]], max_new_tokens=4)[0]) == 4  # up to the switch: runs


def test_longrope_streaming_window_must_stay_within_the_short_factors(longrope):
    _, gen = longrope
    with pytest.raises(InvalidOptionError, match="LongRoPE"):
        gen.generate_ids([_prompt(8, 3)], max_new_tokens=4, n_ctx=SWITCH + 1, n_keep=2)
    assert len(gen.generate_ids([_prompt(80, 3)], max_new_tokens=4, n_ctx=SWITCH, n_keep=2)[0]) == 4


def test_longrope_with_equal_factors_keeps_the_whole_context():
    """Equal short and long factors: one table serves every length, so nothing is capped."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": PHI3_LONG_FACTORS, "long_factor": PHI3_LONG_FACTORS}
    hf = build_phi3("phi3-longrope", rope_parameters=rope)
    gen = fastdecode.from_hf(hf)
    assert gen.config.max_position_embeddings == 256
    ids = _prompt(100, 4)  # past original_max_position_embeddings
    torch.testing.assert_close(prefill_logits(gen, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)


def test_phi3_unknown_rope_scaling_is_refused_by_name(tmp_path):
    hf = build("phi3-swa")
    hf.save_pretrained(tmp_path)
    config = (tmp_path / "config.json")
    config.write_text(config.read_text().replace('"rope_type": "default"', '"rope_type": "dynamic", "factor": 2.0'))
    with pytest.raises(UnsupportedModelError, match="'dynamic'"):
        fastdecode.load(str(tmp_path))


@pytest.mark.parametrize("caps", [{}, {"attn_logit_softcapping": None}, {"final_logit_softcapping": None}],
                         ids=["both-caps", "no-attention-cap", "no-final-cap"])
def test_gemma2_soft_caps_each_matter_and_match_transformers(caps):
    """Each cap moves these logits by far more than the tolerance, and with either one off (an
    explicit null in the config) the logits are still transformers'."""
    hf, capped = build("gemma2", **caps), build("gemma2")
    ids = _prompt(30, 5)  # past the window of 8
    reference = _hf_logits(hf, ids)
    if caps:
        assert (reference - _hf_logits(capped, ids)).abs().max() > 0.1
    torch.testing.assert_close(prefill_logits(fastdecode.from_hf(hf), ids), reference, atol=ATOL, rtol=0)


def test_gemma2_scaled_rope_is_refused_by_name(tmp_path):
    hf = build("gemma2")
    hf.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"rope_type": "default"', '"rope_type": "linear", "factor": 2.0'))
    with pytest.raises(UnsupportedModelError, match="'linear'"):
        fastdecode.load(str(tmp_path))


def test_phi3_config_json_of_transformers_4():
    """The config.json shapes Microsoft ships: Phi-3-mini-128k (4.x ``rope_scaling`` of type "su",
    no factor: the growth is max / original = 32) and Phi-4-mini (``longrope``, 3/4 of the head
    rotated, tied). Both get the attention factor sqrt(1 + ln 32 / ln 4096) and the switch as context."""
    from fastdecode.models.phi3 import config_from_hf

    common = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "vocab_size": 32064, "hidden_size": 3072,
              "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 8192,
              "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rope_theta": 10000.0}
    mini = config_from_hf(common | {"num_key_value_heads": 32, "sliding_window": 262144, "rope_scaling": {
        "type": "su", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48}})
    phi4 = config_from_hf(common | {"num_key_value_heads": 8, "partial_rotary_factor": 0.75,
                                    "tie_word_embeddings": True, "rope_scaling": {
                                        "type": "longrope", "short_factor": [1.0] * 36, "long_factor": [2.0] * 36}})
    expected = (1 + math.log(32) / math.log(4096)) ** 0.5
    for config, half_rotary in ((mini, 48), (phi4, 36)):
        assert config.max_position_embeddings == 4096
        inv_freq, factor = rope_inverse_frequencies(int(96 * config.partial_rotary_factor), config.rope_theta,
                                                    config.rope_scaling, config.max_position_embeddings)
        assert inv_freq.shape == (half_rotary,) and factor == pytest.approx(expected)
    assert mini.sliding_window == 262144 and phi4.tie_word_embeddings and phi4.num_kv_heads == 8
