"""fastdecode vs transformers on tiny random decoder-only models (fp32): the oracle tests."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from engine_helpers import OneSequence, prompt_logits
from tiny_models import DECODER_KINDS, VOCAB, build, hf_greedy

pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=DECODER_KINDS)
def pair(request, tmp_path_factory):
    """(kind, HF model, fastdecode Generator loaded from the saved safetensors folder)."""
    hf = build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, fastdecode.load(str(folder))


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=generator, device="cpu").tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [T, V]


_hf_greedy = hf_greedy


def test_prefill_and_every_cached_step_match_transformers(pair):
    kind, hf, gen = pair
    prompt = _prompt(11, seed=1)
    continuation = _hf_greedy(hf, prompt, 20)
    full = prompt + continuation
    reference = _hf_logits(hf, full)  # [T, V]

    sequence = OneSequence(gen, len(full))
    prefill = sequence.run(prompt)
    torch.testing.assert_close(prefill, reference[: len(prompt)], atol=ATOL, rtol=0)
    for offset, token in enumerate(continuation[:-1]):
        step = sequence.run([token], prompt=False)[0]  # one decode step
        torch.testing.assert_close(step, reference[len(prompt) + offset], atol=ATOL, rtol=0,
                                   msg=lambda m: f"{kind} step {offset}: {m}")


def test_greedy_tokens_identical_to_transformers(pair):
    kind, hf, gen = pair
    for seed, length in ((2, 5), (3, 17)):
        prompt = _prompt(length, seed)
        ours = gen.generate_ids([prompt], max_new_tokens=NEW_TOKENS)[0]
        assert ours == _hf_greedy(hf, prompt, NEW_TOKENS), kind


def test_padded_batch_equals_each_prompt_alone(pair):
    kind, hf, gen = pair
    prompts = [_prompt(n, seed) for seed, n in ((4, 3), (5, 14), (6, 9), (7, 1))]
    batched = gen.generate_ids(prompts, max_new_tokens=24)
    alone = [gen.generate_ids([p], max_new_tokens=24)[0] for p in prompts]
    assert batched == alone, kind


def test_cached_equals_naive_recompute(pair):
    kind, hf, gen = pair
    prompts = [_prompt(6, 8), _prompt(13, 9)]
    cached = gen.generate_ids(prompts, max_new_tokens=24)
    naive = gen.generate_ids(prompts, max_new_tokens=24, use_cache=False)
    assert cached == naive, kind


def test_from_hf_equals_load_of_saved_folder(pair):
    kind, hf, gen = pair
    wrapped = fastdecode.from_hf(hf)
    prompt = _prompt(9, 10)
    assert wrapped.generate_ids([prompt], max_new_tokens=16) == gen.generate_ids([prompt], max_new_tokens=16)
    a, b = prompt_logits(wrapped, prompt)[-1:], prompt_logits(gen, prompt)[-1:]  # the last position's [1, V]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_from_hf_shares_weights_instead_of_copying(pair):
    kind, hf, _ = pair
    wrapped = fastdecode.from_hf(hf)
    hf_pointers = {p.data_ptr() for p in hf.parameters()}
    embed = wrapped.model.embed
    assert embed.data_ptr() in hf_pointers, kind
    assert wrapped.model.layers[0].down.data_ptr() in hf_pointers, kind


def test_sliding_window_is_exercised_past_the_window():
    """Mistral's window (8) is far shorter than the sequences above; check the mask really cuts."""
    hf = build("mistral")
    gen = fastdecode.from_hf(hf)
    prompt = _prompt(20, 11)
    reference = _hf_logits(hf, prompt)
    full_attention = build("mistral")
    full_attention.config.sliding_window = None
    assert not torch.allclose(reference, _hf_logits(full_attention, prompt), atol=1e-3)
    ours = prompt_logits(gen, prompt)
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("n", [2, 3])
def test_greedy_no_repeat_ngram_identical_to_transformers(kind, n, tmp_path):
    hf = build(kind)
    hf.save_pretrained(tmp_path)
    gen = fastdecode.load(str(tmp_path))
    for seed, length in ((8, 4), (9, 13)):
        prompt = _prompt(length, seed)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, length, dtype=torch.long),
                              max_new_tokens=40, min_new_tokens=40, do_sample=False, no_repeat_ngram_size=n)
        ours = gen.generate_ids([prompt], max_new_tokens=40, no_repeat_ngram_size=n)[0]
        assert ours == out[0, length:].tolist(), (kind, n)
