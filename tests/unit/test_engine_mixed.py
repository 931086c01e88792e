"""Every strategy in one engine (issue 30): greedy, seeded sampling, beam search, streams past
``n_ctx`` (shift and re-evaluate), scoring (plain and through a stream) and prompt-lookup
speculation arrive at random steps of ONE engine, and each result is identical to the same request
run alone in an engine of its own; cancelling a beam group and a stream mid-way leaves every block
free. (The encoder-decoder mix of greedy, sampling and beam groups: test_engine_beam_groups.py.)"""

from __future__ import annotations

import random

import pytest
import torch

import fastdecode
from tiny_models import VOCAB, build

pytest.importorskip("transformers")

GENERATE = [  # options of the generating requests
    {"max_new_tokens": 9},
    {"max_new_tokens": 8, "do_sample": True, "temperature": 0.8, "top_k": 20, "seed": 3},
    {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 6, "length_penalty": 0.8},
    {"n_ctx": 20, "n_keep": 3, "policy": "shift", "max_new_tokens": 18},
    {"n_ctx": 18, "n_keep": 2, "policy": "reevaluate", "max_new_tokens": 12},
    {"num_beams": 2, "max_new_tokens": 7, "no_repeat_ngram_size": 2},
    {"max_new_tokens": 10, "speculative": {"method": "ngram", "num_tokens": 3}},
    {"max_new_tokens": 6, "do_sample": True, "top_p": 0.9, "seed": 8, "n_ctx": 16, "n_keep": 4, "policy": "shift"},
]
SCORE = [None, {"n_ctx": 16, "n_keep": 2, "policy": "shift"}]  # scoring: the whole text, or through a stream


@pytest.fixture(scope="module")
def gen():
    torch.set_num_threads(1)
    return fastdecode.from_hf(build("llama-gqa"))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _submit(engine, gen, kind: str, ids: list[int], options):
    if kind == "score":
        config = None if options is None else gen.requests.generation_config(dict(options, max_new_tokens=0))
        return engine.submit_scoring(ids, 2, config)
    return engine.submit(ids, options)


def _outcome(sequence):
    if sequence.keeps_logits:  # a scoring sequence: every position's logprob and its top 2
        return [round(v, 5) for v in sequence.logprobs], [[t for t, _ in row] for row in sequence.top]
    if sequence.group is not None:
        return [(r.tokens, r.finish_reason, round(r.score, 4)) for r in sequence.group.results]
    return sequence.output_ids, sequence.stop_kind


def _all_free(engine) -> bool:
    pools = [engine.cache.pool, *engine.cache.window_pools.values()]
    return all(pool.num_free == pool.num_blocks and pool.reserved == 0 for pool in pools)


def _alone(gen, kind, ids, options):
    engine = gen.engine()
    sequence = _submit(engine, gen, kind, ids, options)
    while engine.has_work():
        engine.step()
    assert _all_free(engine)
    return _outcome(sequence)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_strategy_at_random_steps_equals_each_alone(gen, seed):
    rng = random.Random(seed)
    requests = [("generate", _ids(rng.randint(1, 30), 100 * seed + i), options) for i, options in enumerate(GENERATE)]
    requests += [("score", _ids(rng.randint(12, 45), 100 * seed + 50 + i), options) for i, options in enumerate(SCORE)]
    rng.shuffle(requests)
    arrivals = sorted(rng.randrange(0, 10) for _ in requests)
    engine = gen.engine(max_batch_tokens=rng.choice([24, 48]), prefill_chunk=rng.choice([8, 16]))
    submitted, step = {}, 0
    while len(submitted) < len(requests) or engine.has_work():
        for index, at in enumerate(arrivals):
            if at == step:
                submitted[index] = _submit(engine, gen, *requests[index])
        engine.step()
        step += 1
    assert all(sequence.finished for sequence in submitted.values())
    for index, request in enumerate(requests):
        assert _outcome(submitted[index]) == _alone(gen, *request), request
    assert _all_free(engine)


def test_a_beam_group_and_a_stream_cancelled_mid_way_free_every_block(gen):
    engine = gen.engine(max_batch_tokens=32, prefill_chunk=8)
    group = engine.submit(_ids(17, 1), {"num_beams": 3, "max_new_tokens": 40, "min_new_tokens": 40})
    stream = engine.submit(_ids(25, 2), {"n_ctx": 20, "n_keep": 3, "policy": "shift", "max_new_tokens": None})
    scored = engine.submit_scoring(_ids(60, 3), 0, gen.requests.generation_config({"n_ctx": 16, "max_new_tokens": 0}))
    greedy = engine.submit(_ids(6, 4), {"max_new_tokens": 30})
    for _ in range(12):  # the beams forked, the stream and the scored text passed n_ctx
        engine.step()
    assert len(group.group.beams) == 3 and stream.num_computed > 20 and not (group.finished or stream.finished)
    group.cancel()
    stream.cancel()
    while engine.has_work():
        engine.step()
    assert group.stop_kind == stream.stop_kind == "cancelled"
    assert greedy.output_ids == _alone(gen, "generate", _ids(6, 4), {"max_new_tokens": 30})[0]
    assert scored.finished and len(scored.logprobs) == 59
    assert _all_free(engine)
