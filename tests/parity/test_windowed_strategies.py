"""Every strategy on sliding-window models: Mistral (every layer windowed), Qwen2 with per-layer windows
(max_window_layers), Gemma 3 (sliding layers around a full one, each kind with its RoPE base), Phi-3 with
a window on every layer and Gemma 2 (sliding and full layers alternating, attention soft-capped).
Each model's window (8) is far shorter than the sequences, against transformers or an explicit
reference. (Greedy, padded batch, cached == naive and beam parity for these kinds run in
test_decoder_parity.py and test_beam_parity.py.)"""

from __future__ import annotations

import pytest
import torch

import fastdecode
from stream_alone import StreamAlone
from streaming_reference import ExplicitShiftEngine, logit_trace
from tiny_models import VOCAB, build

pytest.importorskip("transformers")
ATOL = 1e-4
WINDOWED = ["mistral", "qwen2-swa", "gemma3", "phi3-swa", "gemma2"]


@pytest.fixture(scope="module", params=WINDOWED)
def pair(request):
    hf = build(request.param)
    return request.param, hf, fastdecode.from_hf(hf)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed), device="cpu").tolist()


def _hf_nll(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]  # [N-1, V]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="none")


def test_the_window_really_cuts(pair):
    """The same weights with a window wider than the sequence give other logits: the tests below
    would notice a window ignored."""
    kind, hf, _ = pair
    ids = _ids(30, 1)
    wide = build(kind)
    wide.config.sliding_window = 1000
    with torch.no_grad():
        assert not torch.allclose(hf(torch.tensor([ids])).logits, wide(torch.tensor([ids])).logits, atol=1e-3)


@pytest.mark.parametrize("options", [{}, {"n_ctx": 128, "policy": "shift"}, {"n_ctx": 128, "policy": "reevaluate"}],
                         ids=["plain", "shift", "reevaluate"])
def test_score_matches_transformers(pair, options):
    """Within n_ctx nothing is dropped, so every policy must give transformers' NLL (the shift policy
    used to ignore the window here: 0.149 nats per token off on Mistral)."""
    kind, hf, gen = pair
    ids = _ids(100, 2)
    ours = torch.tensor(gen.score(ids, **options))
    torch.testing.assert_close(ours, _hf_nll(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_keep, n_discard", [(4, 1), (4, 5), (0, 3)])
def test_shift_equals_explicit_key_rotation(pair, n_keep, n_discard):
    """Past n_ctx: the shift policy (sinks moved up with each layer's RoPE table, the window left in place)
    equals its definition (every kept key rotated back), windows seen in the shifted frame."""
    kind, _, gen = pair
    tokens = torch.tensor(_ids(60, 3))
    ours = logit_trace(StreamAlone(gen.model, 24, n_keep, n_discard), tokens)
    reference = logit_trace(ExplicitShiftEngine(gen.model, 24, n_keep, n_discard), tokens)
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


def test_chunked_shift_scoring_equals_token_by_token(pair):
    kind, _, gen = pair
    ids = _ids(80, 4)
    chunked = torch.tensor(gen.score(ids, n_ctx=24, n_keep=4, n_discard=3))
    trace = logit_trace(StreamAlone(gen.model, 24, 4, 3), torch.tensor(ids[:-1]))
    one_by_one = torch.nn.functional.cross_entropy(trace, torch.tensor(ids[1:]), reduction="none")
    torch.testing.assert_close(chunked, one_by_one, atol=ATOL, rtol=0)


def _hf_reevaluate(hf, prompt, new_tokens, n_ctx, n_keep, n_discard):
    """Re-evaluate by its definition, on transformers: when the context is full, drop tokens and
    run the model afresh on what is kept (positions from 0)."""
    context, out = list(prompt), []
    while len(context) > n_ctx:  # the prompt itself goes through the policy
        context = context[:n_keep] + context[n_keep + n_discard :]
    for _ in range(new_tokens):
        with torch.no_grad():
            token = int(hf(torch.tensor([context])).logits[0, -1].argmax())
        out.append(token)
        if len(context) == n_ctx:
            context = context[:n_keep] + context[n_keep + n_discard :]
        context.append(token)
    return out


def test_reevaluate_equals_transformers_on_the_kept_tokens(pair):
    kind, hf, gen = pair
    prompt = _ids(10, 5)
    ours = gen.generate_ids([prompt], max_new_tokens=40, n_ctx=24, n_keep=4, n_discard=6, policy="reevaluate")[0]
    assert ours == _hf_reevaluate(hf, prompt, 40, 24, 4, 6)


def test_sampled_tokens_come_from_transformers_top_k_on_a_padded_batch(pair):
    """Whatever the random draws, each sampled token (top_k=3) must be among transformers' 3 best
    at its step, given that row's own history (a window ignored would shift the logits)."""
    kind, hf, gen = pair
    prompts = [_ids(13, 6), _ids(4, 7)]
    options = dict(do_sample=True, top_k=3, seed=3, max_new_tokens=24)
    rows = gen.generate_ids(prompts, **options)
    assert rows == gen.generate_ids(prompts, **options)  # seeded: reproducible
    for prompt, row in zip(prompts, rows):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + row])).logits[0, len(prompt) - 1 : -1]  # [new, V]
        best = logits.topk(3).indices
        assert all(token in best[step] for step, token in enumerate(row)), kind


def test_streaming_generation_equals_plain_within_the_context(pair):
    kind, _, gen = pair
    prompt = _ids(9, 8)
    plain = gen.generate_ids([prompt], max_new_tokens=30)
    for policy in ("shift", "reevaluate"):
        assert gen.generate_ids([prompt], max_new_tokens=30, n_ctx=64, policy=policy) == plain, policy


def test_inspect_counts_layers_and_kv_bytes_per_kind():
    info = fastdecode.from_hf(build("gemma3")).inspect()
    per_layer = 2 * 1 * 32 * 4  # K and V of one KV head of 32 floats
    assert info["attention_layers"] == "3 sliding (window 8), 1 full"
    assert info["kv_cache_bytes_per_token_by_kind"] == {"full_attention": per_layer, "sliding_attention": 3 * per_layer}


@pytest.mark.parametrize("overrides, pattern", [
    ({"layer_types": ["full_attention"] * 3}, "names 3 layers"),
    ({"layer_types": ["chunked_attention"] * 4}, "unsupported attention layer type"),
    ({"sliding_window": None}, "need a sliding_window"),
    ({"attn_logit_softcapping": 50.0}, "softcapping"),
])
def test_bad_layer_configs_are_refused(overrides, pattern):
    from fastdecode.errors import UnsupportedModelError
    from fastdecode.models.gemma3 import config_from_hf

    hf_config = build("gemma3").config.to_dict() | overrides
    with pytest.raises(UnsupportedModelError, match=pattern):
        config_from_hf(hf_config)


def test_gemma3_config_json_of_transformers_4():
    """The config.json Google ships for Gemma 3 (transformers 4.x names): one RoPE base per kind, the
    scaling on global layers only, the 5:1 pattern from sliding_window_pattern when no layer_types."""
    from fastdecode.models.gemma3 import config_from_hf

    config = config_from_hf({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
        "hidden_size": 640, "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "intermediate_size": 2048, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "eos_token_id": [1, 106]})
    assert config.layer_windows == ([512] * 5 + [None]) * 2
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling["factor"]) == (1e6, 1e4, 8.0)
    assert config.eos_token_ids == [1, 106] and config.tie_word_embeddings
