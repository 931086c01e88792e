"""The engine: continuous batching gives each request exactly what it gets alone (and what
transformers gives), on every attention kind; cancellation, leaks, the prefix cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastdecode
from fastdecode.errors import InvalidOptionError, PromptTooLongError, QueueFullError
from engine_helpers import prompt_logits, run_arrivals, run_short_requests
from tiny_models import VOCAB, build, hf_greedy

pytest.importorskip("transformers")

KINDS = ["llama-mha", "llama-gqa", "llama-mqa", "mistral", "bloom", "gpt2"]
# Requests with different lengths, options and stop conditions (greedy next to seeded sampling
# next to repetition penalty, an EOS, n-gram blocking, a prompt longer than the step budget).
REQUESTS = [
    (13, {"max_new_tokens": 12}),
    (5, {"max_new_tokens": 9, "do_sample": True, "seed": 3, "top_k": 20, "temperature": 0.8}),
    (17, {"max_new_tokens": 10, "repetition_penalty": 1.4}),
    (3, {"max_new_tokens": 14, "eos_token_id": 7}),
    (9, {"max_new_tokens": 8, "no_repeat_ngram_size": 2, "do_sample": True, "seed": 5, "top_p": 0.9}),
    (30, {"max_new_tokens": 6}),
]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    hf = build(request.param)
    return request.param, hf, fastdecode.from_hf(hf)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(gen, prompt, options) -> list[int]:
    return run_arrivals(gen.engine(max_batch_tokens=8), {0: [(prompt, options)]})[0]


def test_joined_a_running_batch_equals_alone_equals_transformers(pair):
    kind, hf, gen = pair
    requests = [(_prompt(n, seed), options) for seed, (n, options) in enumerate(REQUESTS)]
    alone = [_alone(gen, p, o) for p, o in requests]
    arrivals = {0: requests[:2], 2: requests[2:4], 5: requests[4:]}  # later ones join running sequences
    assert run_arrivals(gen.engine(max_batch_tokens=8), arrivals) == alone
    greedy_prompt = requests[0][0]
    assert alone[0] == hf_greedy(hf, greedy_prompt, 12)
    if kind == "mistral":  # the window (8) is exceeded, so it shapes the result
        assert len(greedy_prompt) + 12 > hf.config.sliding_window


@settings(max_examples=6, deadline=None)
@given(arrival_steps=st.lists(st.integers(0, 12), min_size=len(REQUESTS), max_size=len(REQUESTS)),
       budget=st.sampled_from([4, 9, 64]), prefill_chunk=st.sampled_from([1, 5, 256]))
def test_any_arrival_steps_and_budget_give_the_alone_result(llama_gen, arrival_steps, budget, prefill_chunk):
    gen, requests, alone = llama_gen
    arrivals: dict[int, list] = {}
    for step, request in zip(arrival_steps, requests):
        arrivals.setdefault(step, []).append(request)
    order = [r for step in sorted(arrivals) for r in arrivals[step]]
    outputs = run_arrivals(gen.engine(max_batch_tokens=budget, prefill_chunk=prefill_chunk), arrivals)
    assert outputs == [alone[requests.index(r)] for r in order]


@pytest.fixture(scope="module")
def llama_gen():
    gen = fastdecode.from_hf(build("llama-gqa", seed=2))
    requests = [(_prompt(n, 40 + seed), options) for seed, (n, options) in enumerate(REQUESTS)]
    return gen, requests, [_alone(gen, p, o) for p, o in requests]


def test_prompt_chunks_are_capped_while_others_decode(llama_gen):
    gen, requests, alone = llama_gen
    engine = gen.engine(max_batch_tokens=64, prefill_chunk=5)
    first = engine.submit(_prompt(6, 1), {"max_new_tokens": 30})
    engine.step()  # nobody decodes yet: the whole 6-token prompt runs at once
    assert engine.tokens_run == 6 and first.num_computed == 6
    second = engine.submit(_prompt(23, 2), {"max_new_tokens": 3})
    steps = []
    while second.num_computed < second.num_prompt_tokens:
        before = engine.tokens_run
        engine.step()
        steps.append(engine.tokens_run - before)
    assert steps == [1 + 5, 1 + 5, 1 + 5, 1 + 5, 1 + 3]  # one decode token + at most 5 prompt tokens
    while engine.has_work():
        engine.step()
    assert second.output_ids == _alone(gen, _prompt(23, 2), {"max_new_tokens": 3})
    with pytest.raises(InvalidOptionError, match="prefill_chunk"):
        gen.engine(prefill_chunk=0)


def test_prompts_arriving_together_are_read_a_few_per_step(llama_gen):
    """With nobody decoding, the first prompt runs whole whatever its length (a lone prompt's fastest first
    token) and the prompts behind it join only up to ``prefill_chunk`` tokens in all, so the first of them
    get their first token without waiting for everyone's prompt."""
    gen, requests, alone = llama_gen
    engine = gen.engine(max_batch_tokens=64, prefill_chunk=8)
    first, second, third = (engine.submit(_prompt(n, 60 + n), {"max_new_tokens": 3}) for n in (6, 6, 20))
    engine.step()  # the first prompt whole, then 2 tokens of the second (8 in all)
    assert (engine.tokens_run, first.num_computed, second.num_computed, third.num_computed) == (8, 6, 2, 0)
    assert len(first.output_ids) == 1
    while engine.has_work():
        engine.step()
    for sequence, n in ((first, 6), (second, 6), (third, 20)):
        assert sequence.output_ids == _alone(gen, _prompt(n, 60 + n), {"max_new_tokens": 3})
    lone = gen.engine(max_batch_tokens=64, prefill_chunk=8)
    long_prompt = lone.submit(_prompt(30, 5), {"max_new_tokens": 2})
    lone.step()  # nobody decodes: a 30-token prompt runs in one step, past prefill_chunk
    assert lone.tokens_run == 30 and len(long_prompt.output_ids) == 1


def test_generate_ids_equals_the_engine_alone(llama_gen):
    gen, requests, alone = llama_gen
    greedy = [r for r in requests if not r[1].get("do_sample")]
    for (prompt, options), expected in zip(requests, alone):
        assert gen.generate_ids([prompt], **options)[0] == expected
    assert gen.generate_ids([p for p, _ in greedy[:2]], max_new_tokens=12) == [
        _alone(gen, p, {"max_new_tokens": 12}) for p, _ in greedy[:2]]
    sampled = {"max_new_tokens": 8, "do_sample": True, "seed": 9}  # a prompt samples the same in a batch
    prompts = [p for p, _ in requests[:3]]
    assert gen.generate_ids(prompts, **sampled) == [gen.generate_ids([p], **sampled)[0] for p in prompts]


def test_cancel_frees_the_slots_and_reports_the_end(llama_gen):
    gen = llama_gen[0]
    engine = gen.engine(cache_tokens=256)
    pool = engine.cache.pool
    keep = engine.submit(_prompt(20, 1), {"max_new_tokens": 40})
    drop = engine.submit(_prompt(30, 2), {"max_new_tokens": 60})
    engine.step()
    engine.step()
    busy = pool.num_free
    drop.cancel()
    events = engine.step()
    assert [(e.token_id, e.finish_reason) for e in events if e.sequence is drop] == [(None, "cancelled")]
    assert drop.finished and drop.finish_reason == "cancelled"
    assert pool.num_free == busy + pool.blocks_for(30 + 60)
    keep.cancel()
    engine.step()
    assert pool.num_free == pool.num_blocks and not engine.has_work()


def test_a_thousand_short_requests_leave_nothing_behind(llama_gen):
    gen = llama_gen[0]
    engine = gen.engine(max_batch_tokens=512, max_queue=1000, cache_tokens=4096)
    refs = run_short_requests(engine, 1000, range(2, VOCAB), 4)
    gc.collect()
    assert all(ref() is None for ref in refs)  # the engine keeps no finished sequence alive


@pytest.mark.parametrize("options", [{}, {"do_sample": True, "seed": 1}, {"num_beams": 2},
                                     {"speculative": "ngram"}], ids=["greedy", "sampling", "beam", "ngram"])
def test_a_calls_engine_is_freed_when_the_call_returns_not_at_a_collection(llama_gen, monkeypatch, options):
    """No reference cycle holds a generate call's engine: its K/V cache is freed when the call returns
    (in a cycle it lived until the next garbage collection, and each call's cache took fresh memory)."""
    import fastdecode.api

    engines = []

    def submit_call(*args):
        engine, sequences = submit(*args)
        engines.append(weakref.ref(engine))
        return engine, sequences

    submit, gen = fastdecode.api.submit_call, llama_gen[0]
    monkeypatch.setattr(fastdecode.api, "submit_call", submit_call)
    gc.collect()
    gc.disable()
    try:
        gen.generate_ids([_prompt(20, 3)], max_new_tokens=6, **options)
        assert len(engines) == 1 and engines[0]() is None
    finally:
        gc.enable()


def test_prefix_cache_runs_only_the_rest_and_equals_a_coldrun_arrivals(llama_gen):
    gen = llama_gen[0]
    prefix = _prompt(200, 7)
    first, second = prefix + _prompt(9, 8), prefix + _prompt(6, 9)
    engine = gen.engine(cache_tokens=1024)
    run_arrivals(engine, {0: [(first, {"max_new_tokens": 5})]})
    before = engine.tokens_run
    sequence = engine.submit(second, {"max_new_tokens": 8})
    while engine.has_work():
        engine.step()
    cached = sequence.num_cached_prompt_tokens
    assert cached == 192  # the 12 full 16-token blocks of the shared 200 tokens
    assert engine.tokens_run - before == len(second) - cached + 8 - 1  # the rest, then one per new token
    assert sequence.output_ids == _alone(gen, second, {"max_new_tokens": 8})


def test_queue_and_capacity_errors_are_typed(llama_gen):
    gen = llama_gen[0]
    engine = gen.engine(max_queue=2, cache_tokens=64)
    engine.submit([3, 4], {"max_new_tokens": 2})
    engine.submit([3, 4], {"max_new_tokens": 2})
    with pytest.raises(QueueFullError):
        engine.submit([3, 4], {"max_new_tokens": 2})
    with pytest.raises(PromptTooLongError, match="cache slots"):
        gen.engine(cache_tokens=64).submit([3] * 60, {"max_new_tokens": 10})
    with pytest.raises(InvalidOptionError, match="beam"):
        gen.engine().submit([3, 4], {"num_beams": 2, "logprobs": 1})  # beam groups run in the engine, without logprobs
    with pytest.raises(InvalidOptionError, match="logprobs"):
        gen.engine().submit([3, 4], {"logprobs": -1})


def test_logprobs_are_the_raw_log_softmax(llama_gen):
    gen = llama_gen[0]
    prompt = _prompt(6, 3)
    engine = gen.engine()
    sequence = engine.submit(prompt, {"max_new_tokens": 1, "logprobs": 3})
    (event,) = engine.step()
    logits = prompt_logits(gen, prompt)[-1]  # one forward over the prompt alone as the reference
    expected = logits.log_softmax(-1)
    assert event.token_id == int(expected.argmax()) and event.finish_reason == "length"
    assert event.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert [t for t, _ in event.top_logprobs] == expected.topk(3).indices.tolist()
    assert sequence.output_ids == [event.token_id]


@pytest.mark.parametrize("name", ["max_batch_tokens", "max_queue", "prefill_chunk"])
@pytest.mark.parametrize("value", [0, -3, True, 2.0, "8", None])
def test_engine_sizes_must_be_positive_ints(llama_gen, name, value):
    gen = llama_gen[0]
    with pytest.raises(InvalidOptionError, match=f"{name} must be an integer >= 1, got {value!r}"):
        gen.engine(**{name: value})


def test_token_choice_runs_on_one_thread(llama_gen, monkeypatch):
    """A step's processors and draws run on one torch thread whatever the forward's budget: small ops
    over one row each, which a second thread's barriers only slow (engine/sampler.py)."""
    from fastdecode.decoding.sampling import TokenSelector

    seen = []
    select = TokenSelector.select
    monkeypatch.setattr(TokenSelector, "select",
                        lambda self, *args: seen.append(torch.get_num_threads()) or select(self, *args))
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llama_gen[0].generate_ids([[3, 4, 5]], max_new_tokens=3, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
    finally:
        torch.set_num_threads(previous)
    assert seen and set(seen) == {1}


def test_copy_on_write_of_beam_blocks_runs_on_one_thread(llama_gen, monkeypatch):
    """Beams that fork from one parent share its partial last block; the first write copies it (engine/slots.py),
    on one torch thread whatever the forward's budget: each copy is a small op, which waited at OpenMP's barrier
    for a busy second core (engine/runner.py)."""
    from fastdecode.engine.slots import SlotCache

    seen = []
    copy_shared = SlotCache._copy_shared

    def recorded(self, window, blocks, first, last):
        if any(self.pool_of(window).ref_counts[blocks[i]] > 1 for i in range(first, last)):
            seen.append(torch.get_num_threads())
        return copy_shared(self, window, blocks, first, last)

    monkeypatch.setattr(SlotCache, "_copy_shared", recorded)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        llama_gen[0].generate_ids([[3, 4, 5, 6, 7]], max_new_tokens=6, min_new_tokens=6, num_beams=3)
    finally:
        torch.set_num_threads(previous)
    assert seen and set(seen) == {1}


def test_a_prompt_left_with_one_token_past_its_cached_prefix_has_the_cold_runs_bits(smollm):
    """A prompt whose every token but the last is in the prefix cache runs that token as a one-token
    prompt chunk: a prompt row, attending as the prompt's chunks do. It took the decode rows' paged
    attention op instead, and the answer's logprobs moved by roundings (on the embedded model the same
    request then answered other words once its prefix was cached, or as its arrival split its chunks)."""
    tokenizer = smollm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say 2"}],
                                                            add_generation_prompt=True), add_special_tokens=False)
    assert len(prompt) == 33  # two full 16-token blocks and one token
    engine = smollm.engine()

    def answer() -> tuple[int, list[tuple[int, float]]]:
        sequence = engine.submit(prompt, {"max_new_tokens": 4, "logprobs": 0})
        events = []
        while engine.has_work():
            events += [(e.token_id, e.logprob) for e in engine.step() if e.sequence is sequence]
        return sequence.num_cached_prompt_tokens, events

    cold, warm = answer(), answer()
    assert (cold[0], warm[0]) == (0, 32) and warm[1] == cold[1]
