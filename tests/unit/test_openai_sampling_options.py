"""OpenAI's sampling options in the engine and the Python API: logit_bias, presence / frequency
penalties, min_p, ignore_eos and seed -1, each against a hand-written reference loop."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.errors import InvalidOptionError
from fastdecode.decoding.processors import apply_min_p
from tiny_models import VOCAB, build, prefill_logits

transformers = pytest.importorskip("transformers")
PROMPT = [5, 9, 14, 20, 3]


@pytest.fixture(scope="module")
def gen():
    return fastdecode.from_hf(build("llama-gqa", seed=5))


def reference_greedy(gen, prompt: list[int], steps: int, adjust) -> list[int]:
    """Greedy decoding with a full prefill per step; ``adjust(logits [V], generated) -> logits``."""
    ids = list(prompt)
    for _ in range(steps):
        logits = adjust(prefill_logits(gen, ids)[-1].float().clone(), ids[len(prompt):])
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_min_p_matches_transformers():
    logits = torch.randn(4, VOCAB) * 3
    for p in (0.01, 0.1, 0.5):
        expected = transformers.MinPLogitsWarper(min_p=p)(None, logits.clone())
        assert torch.equal(torch.isinf(apply_min_p(logits, p)), torch.isinf(expected))


def test_presence_and_frequency_penalties_are_openai_additive(gen):
    def penalized(logits, generated):
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=VOCAB).float()
        return logits - 0.7 * counts - 1.3 * (counts > 0).float()

    expected = reference_greedy(gen, PROMPT, 16, penalized)
    assert expected != gen.generate_ids([PROMPT], max_new_tokens=16)[0]  # the penalties change the output
    for use_cache in (True, False):  # the engine and the naive loop
        ours = gen.generate_ids([PROMPT], max_new_tokens=16, presence_penalty=1.3, frequency_penalty=0.7,
                                use_cache=use_cache)[0]
        assert ours == expected


def test_logit_bias_adds_to_the_logits(gen):
    plain = gen.generate_ids([PROMPT], max_new_tokens=8)[0]
    banned = {plain[0]: -100.0, 42: 3.5}

    def biased(logits, _generated):
        for token, bias in banned.items():
            logits[token] += bias
        return logits

    expected = reference_greedy(gen, PROMPT, 8, biased)
    assert plain[0] not in expected
    assert gen.generate_ids([PROMPT], max_new_tokens=8, logit_bias=banned)[0] == expected
    assert gen.generate_ids([PROMPT], max_new_tokens=5, logit_bias={7: 100.0})[0] == [7] * 5
    assert gen.generate_ids([PROMPT], max_new_tokens=5, num_beams=3, logit_bias={7: 100.0})[0] == [7] * 5
    with pytest.raises(InvalidOptionError, match="logit_bias"):
        gen.generate_ids([PROMPT], max_new_tokens=2, logit_bias={7: 101.0})
    with pytest.raises(InvalidOptionError, match="past the vocabulary"):
        gen.generate_ids([PROMPT], max_new_tokens=2, logit_bias={VOCAB: 1.0})


def test_min_p_sampling_stays_inside_the_kept_set(gen):
    # min_p = 1: only the most likely token survives, so sampling equals greedy
    greedy = gen.generate_ids([PROMPT], max_new_tokens=10)[0]
    assert gen.generate_ids([PROMPT], max_new_tokens=10, do_sample=True, min_p=1.0, seed=3)[0] == greedy
    with pytest.raises(InvalidOptionError, match="min_p"):
        gen.generate_ids([PROMPT], max_new_tokens=2, do_sample=True, min_p=1.5)


def test_ignore_eos_generates_to_max_new_tokens(gen):
    plain = gen.generate_ids([PROMPT], max_new_tokens=8)[0]
    eos = plain[-1]  # make a greedy token the EOS
    stopped = gen.generate_ids([PROMPT], max_new_tokens=8, eos_token_id=eos)[0]
    assert stopped == plain[:plain.index(eos) + 1]
    for use_cache in (True, False):
        assert gen.generate_ids([PROMPT], max_new_tokens=8, eos_token_id=eos, ignore_eos=True,
                                use_cache=use_cache)[0] == plain


def test_seed_minus_one_is_random(gen):
    config = fastdecode.GenerationConfig.from_options(seed=-1, do_sample=True)
    assert config.seed is None
    draws = {tuple(gen.generate_ids([PROMPT], max_new_tokens=12, do_sample=True, seed=-1)[0]) for _ in range(3)}
    assert len(draws) > 1


def test_best_of_keeps_the_most_likely_candidates(gen):
    from engine_helpers import reference_logprobs

    candidates = gen.generate_ids([PROMPT], max_new_tokens=6, do_sample=True, seed=9, num_return_sequences=5)
    totals = [sum(reference_logprobs(gen, PROMPT + c)[0][len(PROMPT) - 1:])
              for c in candidates]
    ranked = [c for _, c in sorted(zip(totals, candidates), key=lambda pair: -pair[0])]
    best = gen.generate_ids_with_details([PROMPT], max_new_tokens=6, do_sample=True, seed=9, best_of=5,
                                         num_return_sequences=2)
    assert [r.tokens for r in best] == ranked[:2]
    assert [r.score for r in best] == pytest.approx(sorted(totals, reverse=True)[:2], abs=1e-4)
    with pytest.raises(InvalidOptionError, match="best_of"):
        gen.generate_ids([PROMPT], max_new_tokens=2, do_sample=True, best_of=1, num_return_sequences=2)
    with pytest.raises(InvalidOptionError, match="best_of"):
        gen.generate_ids([PROMPT], max_new_tokens=2, num_beams=2, best_of=2)
