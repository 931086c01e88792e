"""Speculative decoding in the engine (engine/speculative.py): drafts verified in one forward give
exactly the tokens decoding without them gives (greedy, and seeded sampling for the same seed), on
every attention kind, alone and batched with other requests; the cache then holds exactly the
accepted tokens' K/V and every block is free at the end."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.config.speculative import SpeculativeSettings, speculative_settings
from fastdecode.engine.speculative import NgramDrafter, Speculation, draft_length
from fastdecode.errors import InvalidOptionError
from engine_helpers import run_arrivals
from tiny_models import VOCAB, build

pytest.importorskip("transformers")

KINDS = ["llama-mha", "llama-gqa", "llama-mqa", "mistral", "bloom", "gpt2", "gemma3"]
# A prompt that repeats itself, so prompt lookup finds drafts (some right, some wrong).
LOOPY = [5, 9, 11, 5, 9, 11, 5, 9, 11, 40, 41, 42, 5, 9, 11, 40, 41]
OPTIONS = [
    {"max_new_tokens": 24},
    {"max_new_tokens": 20, "do_sample": True, "seed": 3, "top_k": 20, "temperature": 0.8},
    {"max_new_tokens": 20, "repetition_penalty": 1.3, "no_repeat_ngram_size": 3},
    {"max_new_tokens": 16, "do_sample": True, "seed": 11, "top_p": 0.9, "presence_penalty": 0.5},
]


class ReferenceDrafter:
    """Drafts a known continuation with every ``wrong``-th draft token changed: forces accepted
    prefixes of every length and rejections at every offset."""

    def __init__(self, reference: list[int], wrong: int):
        self.reference, self.wrong, self.generated, self.proposals = reference, wrong, 0, 0

    def extend(self, tokens: list[int]) -> None:
        self.generated += len(tokens)

    def propose(self, count: int) -> list[int]:
        self.proposals += 1
        draft = self.reference[self.generated:self.generated + count]
        if self.proposals % self.wrong == 0 and draft:
            index = self.proposals % len(draft)
            draft[index] = (draft[index] + 1) % VOCAB
        return draft


@pytest.fixture(scope="module", params=KINDS)
def gen(request):
    return fastdecode.from_hf(build(request.param))


def _run(gen, prompt, options, drafter=None, engine=None):
    engine = engine or gen.engine(max_batch_tokens=64)
    sequence = engine.submit(prompt, options)
    if drafter is not None:
        sequence.speculation.drafter = drafter
    while engine.has_work():
        engine.step()
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    return sequence


@pytest.mark.parametrize("options", OPTIONS, ids=["greedy", "sample", "penalties", "sample-presence"])
def test_speculation_gives_the_tokens_of_plain_decoding(gen, options):
    plain = _run(gen, LOOPY, options).output_ids
    lookup = _run(gen, LOOPY, {**options, "speculative": "ngram"})
    assert lookup.output_ids == plain
    forced = _run(gen, LOOPY, {**options, "speculative": {"method": "ngram", "num_tokens": 5}},
                  ReferenceDrafter(plain, wrong=2))
    assert forced.output_ids == plain
    spec = forced.speculation
    assert spec.drafted > spec.accepted > 0  # both acceptances and rejections happened


def test_speculating_rows_batched_with_others_equal_alone(gen):
    requests = [(LOOPY, {**OPTIONS[0], "speculative": "ngram"}), (LOOPY[3:], OPTIONS[1]),
                (LOOPY[::-1], {**OPTIONS[2], "speculative": "ngram"}), (LOOPY[:7], OPTIONS[3]),
                (LOOPY * 2, {**OPTIONS[1], "speculative": "ngram"})]
    alone = [_run(gen, prompt, options).output_ids for prompt, options in requests]
    engine = gen.engine(max_batch_tokens=48)
    arrivals = {0: requests[:2], 3: requests[2:4], 6: requests[4:]}
    assert run_arrivals(engine, arrivals) == alone
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_logprobs_and_eos_inside_a_draft(gen):
    plain = _run(gen, LOOPY, {"max_new_tokens": 24, "logprobs": 2}).output_ids
    eos = plain[10]  # an EOS the model reaches inside an accepted draft
    expected = _run(gen, LOOPY, {"max_new_tokens": 24, "eos_token_id": eos, "logprobs": 2})
    forced = _run(gen, LOOPY, {"max_new_tokens": 24, "eos_token_id": eos, "logprobs": 2, "speculative": "ngram"},
                  ReferenceDrafter(plain, wrong=1000))
    assert forced.output_ids == expected.output_ids and forced.stop_kind == "eos"


def test_cache_holds_exactly_the_accepted_tokens():
    gen = fastdecode.from_hf(build("llama-gqa"))
    plain = _run(gen, LOOPY, {"max_new_tokens": 30}).output_ids
    engine = gen.engine(max_batch_tokens=64)
    kept = engine.add(gen.requests.build(LOOPY, {"max_new_tokens": 30, "speculative": {"num_tokens": 6}}), keep=True)
    kept.speculation.drafter = ReferenceDrafter(plain, wrong=2)
    while engine.has_work():
        engine.step()
    assert kept.output_ids == plain and kept.speculation.drafted > kept.speculation.accepted
    cold = gen.engine(max_batch_tokens=64)
    tokens = kept.tokens(0, kept.num_computed)
    prefilled = cold.add(gen.requests.build(tokens, {"max_new_tokens": 1}), keep=True)
    while cold.has_work():
        cold.step()
    for engine_, sequence in ((engine, kept), (cold, prefilled)):
        slots = engine_.cache.slot_ids(sequence.block_table, 0, len(tokens))
        sequence.cached = [(k[slots], v[slots]) for k, v in zip(engine_.cache.layer_keys, engine_.cache.layer_values)]
    for (k1, v1), (k2, v2) in zip(kept.cached, prefilled.cached):
        torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)
    engine.drop(kept)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_cancel_mid_draft_frees_every_block():
    gen = fastdecode.from_hf(build("llama-gqa"))
    engine = gen.engine(max_batch_tokens=64)
    sequence = engine.submit(LOOPY, {"max_new_tokens": 40, "speculative": "ngram"})
    other = engine.submit(LOOPY[:5], {"max_new_tokens": 40})
    for _ in range(4):
        engine.step()
    sequence.cancel()
    other.cancel()
    engine.step()
    assert not engine.has_work() and engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_encoder_decoder_drafts_from_the_source():
    from tiny_encdec import build as build_encdec

    gen = fastdecode.from_hf(build_encdec("bart", seed=7))
    source = [5, 9, 11, 13, 17, 19, 23, 5, 9, 11, 13, 40, 41]
    for options in ({"max_new_tokens": 16, "min_new_tokens": 16},
                    {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": True, "seed": 2}):
        plain = _run(gen, source, options).output_ids
        assert _run(gen, source, {**options, "speculative": "ngram"}).output_ids == plain
        forced = _run(gen, source, {**options, "speculative": "ngram"}, ReferenceDrafter(plain, wrong=3))
        assert forced.output_ids == plain and forced.speculation.accepted > 0


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    drafter = NgramDrafter([1, 2, 3, 4, 9, 1, 2, 3, 5, 6], ngram_min=2, ngram_max=3)
    drafter.extend([1, 2])
    assert drafter.propose(3) == [3, 5, 6]  # "1 2" last followed by 3 5 6 (the latest occurrence)
    drafter.extend([3, 4])
    assert drafter.propose(2) == [9, 1]  # "2 3 4" (longest first) followed by 9 1
    assert NgramDrafter([1, 2, 3], 2, 3).propose(4) == []
    periodic = NgramDrafter([7, 8, 7, 8, 7], 2, 2)
    assert periodic.propose(5) == [8, 7, 8, 7, 8]  # a loop continues past the sequence's end
    source = NgramDrafter([30, 31], 2, 2, documents=([30, 31, 32, 33],))
    assert source.propose(2) == [32, 33]  # an encoder-decoder's source is searched too


def test_draft_lengths_keep_verify_rows_a_power_of_two():
    assert [draft_length(n) for n in range(10)] == [0, 1, 1, 3, 3, 3, 3, 7, 7, 7]
    spec = Speculation(NgramDrafter([1, 2, 1, 2, 1], 1, 2), SpeculativeSettings(num_tokens=8), pauses=False)
    assert spec.length == 3  # the first draft is a short probe: 4 verify rows
    spec.settle(3, 3)
    assert spec.length == 7  # grows while drafts are accepted, up to num_tokens (as 1 + k rows allow)
    spec.settle(7, 2)
    assert spec.length == 3
    spec.settle(3, 0)
    assert spec.length == 1 and spec.paused == 0  # prompt lookup never pauses: a miss shortens the draft
    assert spec.draft(5) == [2]  # "1" last followed by 2 (a 1-token draft)
    assert spec.wanted(2) == 1 and Speculation.shaped([5, 6]) == [5]  # 3 rows cost more than 4: cut to 2
    batched = Speculation(NgramDrafter([1, 2, 1, 2, 1], 1, 2), SpeculativeSettings(num_tokens=8), pauses=False)
    assert batched.wanted(5, batched=True) == 3
    batched.settle(3, 0)
    assert batched.paused == 8  # beside other decoding sequences a miss pauses all the same (rows cost compute)
    for _ in range(3):
        spec.settle(1, 0)
    assert spec.rate < 0.3 and spec.wanted(3) == 0  # drafts that keep missing cost more than they gain
    assert 0 < next(step for step in range(1, 40) if spec.wanted(3)) < 40  # probes again after a while


def test_a_costly_drafter_pauses_after_misses():
    spec = Speculation(NgramDrafter([1, 2, 1, 2, 1], 1, 2), SpeculativeSettings(num_tokens=8), pauses=True)
    spec.settle(3, 0)
    assert spec.paused == 8 and spec.draft(5) == []  # a draft with nothing accepted pauses drafting
    spec.paused = 0
    spec.settle(1, 0)
    assert spec.paused == 16  # a pause right after a pause is longer
    spec.paused = 0
    spec.settle(3, 1)
    assert spec.pause_steps == 8 and spec.length == 1
    lookup = Speculation(NgramDrafter([1, 2, 1, 2, 1], 1, 2), SpeculativeSettings(num_tokens=8), pauses=False)
    spec.rate = lookup.rate = 0.5  # half the drafted tokens accepted: pays for prompt lookup, not a draft model's
    assert spec.wanted(3) == 0 and lookup.wanted(3) == 3


@pytest.mark.parametrize("value, message", [
    ("medusa", "speculative must be"), ({"method": "eagle"}, "method"), ({"num_tokens": 0}, "num_tokens"),
    ({"ngram_min": 4, "ngram_max": 2}, "exceeds"), ({"draft_model": 5}, "model path"),
    ({"method": "draft_model"}, "goes with"),
    ({"k": 3}, "unknown key"), (3, "speculative must be")])
def test_bad_speculative_values_are_refused(value, message):
    with pytest.raises(InvalidOptionError, match=message):
        speculative_settings(value)


def test_strategies_that_cannot_speculate_refuse_it():
    gen = fastdecode.from_hf(build("llama-gqa"))
    for options in ({"num_beams": 2}, {"n_ctx": 16}, {"use_cache": False}):
        with pytest.raises(InvalidOptionError, match="speculative"):
            gen.generate_ids([LOOPY], max_new_tokens=4, speculative="ngram", **options)
    # a default speculation (load / serve) applies where it can run and stays out of beam search
    gen.defaults = gen.requests.generation_config({"speculative": "ngram"})
    assert gen.requests.generation_config({"num_beams": 2}).speculative is None
    assert gen.requests.generation_config({}).speculative == "ngram"
    beams = gen.generate_ids([LOOPY], max_new_tokens=4, num_beams=2)
    assert len(beams) == 1


def test_drafts_keep_copying_from_where_they_matched():
    # "x *" occurs after every function name: once copying function 3's line, the draft stays there
    text = [10, 3, 20, 21, 30, 10, 4, 20, 21, 31, 10, 5, 20, 21, 32]
    drafter = NgramDrafter([], 2, 2, documents=(text,))
    drafter.extend([10, 3])
    assert drafter.propose(3) == [20, 21, 30]
    drafter.extend([20, 21])  # accepted: the next draft continues after them, not after "20 21" of function 5
    assert drafter.propose(2) == [30, 10]
    drafter.extend([99])  # a token the document does not have there: back to lookups
    assert drafter.cursor is None


def test_a_prediction_is_drafted_from_its_start():
    gen = fastdecode.from_hf(build("llama-gqa"))
    plain = _run(gen, LOOPY, {"max_new_tokens": 20}).output_ids
    predicted = _run(gen, LOOPY, {"max_new_tokens": 20, "speculative": {"prediction": plain[:12] + [1, 2, 3]}})
    assert predicted.output_ids == plain
    assert predicted.speculation.accepted >= 11  # the first draft is the prediction's start


def test_batched_sequences_draft_only_while_drafts_pay():
    spec = Speculation(NgramDrafter([1, 2, 1, 2, 1], 1, 2), SpeculativeSettings(num_tokens=4), pauses=False)
    assert spec.wanted(4, batched=True) == 3  # optimistic at first
    for _ in range(3):
        spec.settle(7, 1)
    assert spec.rate < 0.6 and spec.wanted(4, batched=True) == 0 and spec.wanted(4) > 0
    steps = 0
    while spec.wanted(4, batched=True) == 0:  # probes again after a while
        steps += 1
    assert 2 < steps < 40
