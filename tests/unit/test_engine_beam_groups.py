"""Beam search as groups of sequences in the one engine (engine/beam_group.py): several beam
requests arriving at different steps, beside greedy and seeded-sampling requests, each give
what they give alone; a cancelled group frees every block; admission reserves the whole group."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import run_arrival_sequences
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)

import fastdecode
from fastdecode.errors import PromptTooLongError

BEAM = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 7, "length_penalty": 0.7}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from tiny_models import save_tiny_folder

    folder = tmp_path_factory.mktemp("llama")
    save_tiny_folder(folder, "llama-gqa", with_tokenizer=False)
    return fastdecode.load(str(folder))


@pytest.fixture(scope="module")
def encdec(tmp_path_factory):
    from tiny_encdec import save_tiny_encdec_folder

    folder = tmp_path_factory.mktemp("bart")
    save_tiny_encdec_folder(folder, "bart", with_tokenizer=False)
    return fastdecode.load(str(folder))


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 150, (n,), generator=generator).tolist() for n in lengths]


def _requests(prompts, eos):
    """(prompt, options) of every kind, in arrival order."""
    beam = dict(BEAM, eos_token_id=eos)
    kinds = [beam, {"max_new_tokens": 6}, dict(beam, num_beams=2, no_repeat_ngram_size=2),
             {"max_new_tokens": 5, "do_sample": True, "temperature": 0.9, "seed": 11}, dict(beam, early_stopping=True)]
    return [(p, kinds[i % len(kinds)]) for i, p in enumerate(prompts)]


def _outcome(sequence):
    """A finished request's results: (tokens, finish reason, rounded score) of each returned sequence."""
    if sequence.group is not None:
        return [(r.tokens, r.finish_reason, round(r.score, 4)) for r in sequence.group.results]
    return [(sequence.output_ids, sequence.stop_kind, None)]


def _all_free(engine) -> bool:
    pools = [engine.cache.pool, *engine.cache.window_pools.values()]
    if engine.cross is not None:
        pools.append(engine.cross.pool)
    return all(pool.num_free == pool.num_blocks and pool.reserved == 0 for pool in pools)


@pytest.mark.parametrize("model", ["decoder", "encdec"])
def test_beam_groups_mixed_with_other_requests_equal_each_alone(model, request):
    gen = request.getfixturevalue(model)
    prompts = _prompts((5, 19, 3, 33, 8, 12, 1, 21))
    eos = gen.generate_ids([prompts[0]], max_new_tokens=3, min_new_tokens=3)[0][2]  # a token beams really end with
    requests = _requests(prompts, eos)
    alone = []
    for prompt, options in requests:
        engine = gen.engine()
        (sequence,) = run_arrival_sequences(engine, {0: [(prompt, options)]})
        alone.append(_outcome(sequence))
        assert _all_free(engine)
    engine = gen.engine(max_batch_tokens=24, prefill_chunk=16)  # prompt chunks beside decoding beams
    arrivals: dict[int, list] = {}
    for index, item in enumerate(requests):
        arrivals.setdefault(index // 2 * 3, []).append(item)  # two requests every third step
    together = [_outcome(s) for s in run_arrival_sequences(engine, arrivals)]
    assert together == alone
    assert sum(len(o) for o in together if o[0][2] is not None) == 5 * 2  # five beam requests, two results each
    assert _all_free(engine)
    # the Generator routes beam search through the engine: the same results
    beams = [(p, o) for p, o in requests if o.get("num_beams", 1) > 1]
    via_api = [gen.generate_ids_with_details([p], **o) for p, o in beams]
    assert [[(r.tokens, r.finish_reason, round(r.score, 4)) for r in results] for results in via_api] == \
        [o for o, (_, options) in zip(alone, requests) if options.get("num_beams", 1) > 1]


@pytest.mark.parametrize("model", ["decoder", "encdec"])
def test_a_cancelled_group_frees_every_block(model, request):
    gen = request.getfixturevalue(model)
    prompt, other = _prompts((37, 6), seed=2)
    engine = gen.engine()
    group = engine.submit(prompt, {"num_beams": 4, "max_new_tokens": 40, "min_new_tokens": 40})
    greedy = engine.submit(other, {"max_new_tokens": 30})
    for _ in range(6):  # past the fork: the beams hold their own blocks and copies
        engine.step()
    assert len(group.group.beams) == 4 and not group.finished
    group.cancel()
    events = engine.step()
    assert [e.finish_reason for e in events if e.sequence is group] == ["cancelled"]
    assert all(beam.finished for beam in group.group.beams)
    while engine.has_work():
        engine.step()
    assert greedy.finished and greedy.output_ids == gen.generate_ids([other], max_new_tokens=30)[0]
    assert _all_free(engine)


def test_admission_reserves_the_whole_group(decoder):
    """A group waits until its beams' blocks are free (never preempted later), and one that could
    never fit is refused at once."""
    prompt = _prompts((20,), seed=4)[0]
    options = {"num_beams": 4, "max_new_tokens": 30}
    # 2 prompt blocks + 4 beams x (one partial prompt block copy + two blocks of new tokens) = 14 blocks
    engine = decoder.engine(cache_tokens=14 * 16)
    first = engine.submit(prompt, options)
    second = engine.submit(prompt[:5], {"max_new_tokens": 20})  # must wait: the group holds every block
    engine.step()
    assert first in engine.running and list(engine.waiting) == [second]
    while engine.has_work():
        engine.step()
    assert first.finished and second.finished and _all_free(engine)
    with pytest.raises(PromptTooLongError, match="beam search with 4 beams"):
        decoder.engine(cache_tokens=13 * 16).submit(prompt, options)


def test_quantized_beams_never_fold_so_neighbours_never_change_them(tmp_path):
    """A quantized model's decode rows are int8-rounded: a folded step and a paged one would give
    different beams, so its groups never fold and a request beside a short prompt equals it alone."""
    from tiny_models import save_tiny_folder

    from fastdecode.engine.beam_group import folds_beams

    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    gen = fastdecode.load(str(tmp_path), quantize="int8")
    assert gen.model.fused_decode is not None and not folds_beams(gen.model)
    long, short = _prompts((16, 5), seed=6)
    options = {"num_beams": 4, "num_return_sequences": 2, "max_new_tokens": 10, "min_new_tokens": 10}
    alone = [_outcome(run_arrival_sequences(gen.engine(), {0: [(p, options)]})[0]) for p in (long, short)]
    together = [_outcome(s) for s in run_arrival_sequences(gen.engine(), {0: [(long, options), (short, options)]})]
    assert together == alone
