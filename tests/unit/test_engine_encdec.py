"""Encoder-decoder requests through the engine: the encoder once at admission, cross K/V kept per
sequence; each request gets what it gets alone (and what transformers gives), on learned (BART),
sinusoidal (Marian) and relative-bucket (T5) positions; cancellation and leaks."""

from __future__ import annotations

import gc

import pytest
import torch

import fastdecode
from fastdecode.errors import PromptTooLongError
from engine_helpers import run_arrivals, run_short_requests
from tiny_encdec import VOCAB, build, hf_greedy, single_thread  # noqa: F401 (autouse fixture)

pytest.importorskip("transformers")

KINDS = ["bart", "marian", "t5"]
# Sources of different lengths next to different options and stop conditions: greedy, seeded
# sampling, repetition penalty, an EOS, n-gram blocking on the target and on the source.
REQUESTS = [
    (11, {"max_new_tokens": 10, "min_new_tokens": 10}),
    (4, {"max_new_tokens": 8, "do_sample": True, "seed": 3, "top_k": 20, "temperature": 0.8}),
    (17, {"max_new_tokens": 9, "repetition_penalty": 1.6}),
    (6, {"max_new_tokens": 12, "eos_token_id": 9}),
    (9, {"max_new_tokens": 7, "no_repeat_ngram_size": 2, "do_sample": True, "seed": 5, "top_p": 0.9}),
    (13, {"max_new_tokens": 6, "encoder_no_repeat_ngram_size": 2}),
]


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    hf = build(request.param, seed=7)
    return request.param, hf, fastdecode.from_hf(hf)


def _source(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB - 1, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(gen, source, options) -> list[int]:
    return run_arrivals(gen.engine(), {0: [(source, options)]})[0]


@pytest.fixture(scope="module")
def requests_alone(pair):
    gen = pair[2]
    requests = [(_source(n, 10 + seed), options) for seed, (n, options) in enumerate(REQUESTS)]
    return requests, [_alone(gen, s, o) for s, o in requests]


def test_greedy_through_the_engine_equals_transformers(pair):
    kind, hf, gen = pair
    sources = [_source(n, seed) for seed, n in ((1, 5), (2, 17), (3, 1))]
    assert run_arrivals(gen.engine(), {0: [(s, {"max_new_tokens": 12, "min_new_tokens": 12}) for s in sources]}) == \
        hf_greedy(hf, sources, 12), kind


@pytest.mark.parametrize("arrival_steps", [(0, 0, 2, 2, 5, 5), (0, 1, 3, 4, 4, 9), (3, 0, 0, 7, 1, 2)])
def test_joining_a_running_batch_at_any_step_equals_alone(pair, requests_alone, arrival_steps):
    kind, hf, gen = pair
    requests, alone = requests_alone
    arrivals: dict[int, list] = {}
    for step, request in zip(arrival_steps, requests):
        arrivals.setdefault(step, []).append(request)
    order = [r for step in sorted(arrivals) for r in arrivals[step]]
    assert run_arrivals(gen.engine(max_batch_tokens=4), arrivals) == [alone[requests.index(r)] for r in order], kind
    assert alone[0] == hf_greedy(hf, [requests[0][0]], 10)[0]
    assert alone[2] == hf_greedy(hf, [requests[2][0]], 9, min_new_tokens=0, repetition_penalty=1.6)[0]


def test_generate_ids_runs_in_the_engine_and_equals_it_alone(pair, monkeypatch):
    kind, hf, gen = pair
    from fastdecode.engine import Engine

    engines = []
    original = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: engines.append(self) or original(self))
    sources = [_source(n, 30 + n) for n in (3, 12)]
    options = {"max_new_tokens": 8, "do_sample": True, "seed": 4}
    assert gen.generate_ids(sources, **options) == [_alone(gen, s, options) for s in sources]
    assert engines and all(e.cross is not None for e in engines)
    assert list(gen.stream_ids(sources[0], max_new_tokens=5, min_new_tokens=5)) == \
        _alone(gen, sources[0], {"max_new_tokens": 5, "min_new_tokens": 5})


def test_encoder_runs_once_per_admission_step(pair, monkeypatch):
    kind, hf, gen = pair
    calls = []
    original = gen.model.encode
    monkeypatch.setattr(gen.model, "encode", lambda tokens, *rest, **named: calls.append(tokens.shape[0]) or
                        original(tokens, *rest, **named))
    engine = gen.engine()
    run_arrivals(engine, {0: [(_source(5, 1), {"max_new_tokens": 6}), (_source(9, 2), {"max_new_tokens": 6})],
                  3: [(_source(4, 3), {"max_new_tokens": 6})]})
    assert calls == [2, 1]  # the two admitted together share one encoder call; the joiner has its own


def test_the_cross_store_is_written_on_one_thread_under_a_two_thread_caller(pair, monkeypatch):
    """The sources' cross K/V go into their blocks with torch on one thread whatever the caller's budget (each
    block run's copy_ is an OpenMP region: on a shared machine every one waited for the busy core), the same
    tokens as a one-thread caller's."""
    from fastdecode.engine.source_blocks import SourceBlocks

    kind, hf, gen = pair
    threads_seen = []
    original = SourceBlocks.write
    monkeypatch.setattr(SourceBlocks, "write", lambda self, *args: threads_seen.append(torch.get_num_threads()) or
                        original(self, *args))
    def requests():  # (run_arrivals takes them as it admits them)
        options = {"max_new_tokens": 5, "min_new_tokens": 5}
        return {0: [(_source(7, 4), options), (_source(19, 5), options)]}

    alone = run_arrivals(gen.engine(), requests())
    torch.set_num_threads(2)  # (the module's autouse fixture restores the count)
    try:
        assert run_arrivals(gen.engine(), requests()) == alone, kind
    finally:
        torch.set_num_threads(1)
    assert threads_seen and set(threads_seen) == {1} and len(threads_seen) == 2 * gen.model.config.num_layers


def test_cancel_frees_the_self_attention_blocks_and_the_cross_kv(pair):
    kind, hf, gen = pair
    engine = gen.engine(cache_tokens=256, source_tokens=256)
    pool, cross = engine.cache.pool, engine.cross.pool
    keep = engine.submit(_source(20, 1), {"max_new_tokens": 40, "min_new_tokens": 40})
    drop = engine.submit(_source(35, 2), {"max_new_tokens": 30, "min_new_tokens": 30})
    engine.step()
    engine.step()
    busy, cross_busy = pool.num_free, cross.num_free
    drop.cancel()
    events = engine.step()
    assert [(e.token_id, e.finish_reason) for e in events if e.sequence is drop] == [(None, "cancelled")]
    assert pool.num_free == busy + pool.blocks_for(1 + 30)  # decoder start token + new tokens
    assert cross.num_free == cross_busy + cross.blocks_for(35) and drop.source_table == []
    keep.cancel()
    engine.step()
    assert pool.num_free == pool.num_blocks and cross.num_free == cross.num_blocks and not engine.has_work()


def test_two_hundred_short_requests_leave_nothing_behind():
    gen = fastdecode.from_hf(build("bart", seed=1))
    engine = gen.engine(max_batch_tokens=64, max_queue=200, cache_tokens=512, source_tokens=256)
    refs = run_short_requests(engine, 200, range(3, VOCAB - 1), 6)
    assert engine.cross.pool.num_free == engine.cross.pool.num_blocks and not engine.cross.pending
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_source_larger_than_the_cross_store_is_refused_at_submit():
    gen = fastdecode.from_hf(build("t5"))
    with pytest.raises(PromptTooLongError, match="cross-attention"):
        gen.engine(source_tokens=32).submit(list(range(3, 40)), {"max_new_tokens": 2})


def test_the_cross_store_keeps_each_source_from_strided_views_in_scattered_blocks():
    """SourceBlocks.write copies the cross projection's strided [B, H, S, D] views straight into each
    source's blocks (scattered, not in order; a last block partly filled; sources shorter than the
    batch's S): reading a source back gives its own K/V, every real token, and the other blocks keep
    what they held."""
    from fastdecode.engine.source_blocks import SourceBlocks

    H, D, size, lengths = 3, 8, 16, (5, 33, 16, 32)
    cache = SourceBlocks(2, 12, H, D, torch.float32, torch.device("cpu"), size)
    generator = torch.Generator().manual_seed(3)
    projected = torch.randn(len(lengths), max(lengths), 2 * H * D, generator=generator)  # [B, S, 2 * H * D]
    keys, values = (p.view(len(lengths), max(lengths), H, D).transpose(1, 2)  # [B, H, S, D] views
                    for p in projected.split(H * D, dim=-1))
    order = [9, 2, 3, 0, 5, 10, 11, 8, 1]  # blocks handed out of order, some in consecutive runs
    tables, taken = [], 0
    for n in lengths:
        tables.append(order[taken:taken + -(-n // size)])
        taken += len(tables[-1])
    cache.write(1, tables, keys, values)
    for b, n in enumerate(lengths):
        k, v = cache.read(1, tables[b], n)  # [H, n, D]
        assert torch.equal(k, keys[b, :, :n]) and torch.equal(v, values[b, :, :n]), b
    untouched = [i for i in range(12) if i not in order[:taken]]
    assert not cache.layer_keys[1][untouched].any() and not cache.layer_keys[0].any()


@pytest.mark.skipif(not __import__("fastdecode.layers.ops", fromlist=["available"]).available(),
                    reason="no C++ extension: every step gathers")
def test_paged_cross_attention_equals_the_gathered_one(monkeypatch):
    """A step's cross-attention read in place through the sources' block tables (single rows, a beam
    group's K queries of one source, a decoder prompt chunk: each source one row of the op with its
    queries together) gives every query the bits it gets alone, on 1 and 2 threads, and equals
    gathering each group's blocks and attending under the key mask."""
    from types import SimpleNamespace

    from fastdecode.engine import cross as cross_module
    from fastdecode.engine.source_blocks import SourceBlocks

    H, D, size = 3, 16, 16
    cache = SourceBlocks(1, 8, H, D, torch.float32, torch.device("cpu"), size)
    generator = torch.Generator().manual_seed(0)
    cache.layer_keys[0].copy_(torch.randn(cache.layer_keys[0].shape, generator=generator))
    cache.layer_values[0].copy_(torch.randn(cache.layer_values[0].shape, generator=generator))
    sources = [SimpleNamespace(source=[0] * n, source_table=cache.pool.take(cache.pool.blocks_for(n)))
               for n in (5, 33, 16, 1)]
    groups = [(0, sources[:2], 1), (2, sources[2:3], 4), (6, sources[3:], 3)]  # singles, beams of one, a chunk
    q = torch.randn(1, H, 9, D, generator=generator)  # [1, H, N, D]
    paged = cross_module.CrossStep(cache, groups, torch.float32)
    assert paged.paged and [fold.queries for fold in paged.folds] == [1, 3, 4]
    rows = [sources[0], sources[1]] + [sources[2]] * 4 + [sources[3]] * 3
    alone = cross_module.CrossStep(cache, [(i, [s], 1) for i, s in enumerate(rows)], torch.float32)
    assert [fold.queries for fold in alone.folds] == [1]
    folded = paged.attend(0, q, 0.25, 1)
    assert torch.equal(folded, alone.attend(0, q, 0.25, 1))
    assert torch.equal(folded, paged.attend(0, q, 0.25, 2))  # 1 and 2 threads: the same bits
    monkeypatch.setattr(cross_module, "paged_cross_attention_runs", lambda *args: False)
    gathered = cross_module.CrossStep(cache, groups, torch.float32)
    assert not gathered.paged and [fold.queries for fold in gathered.folds] == [1, 3, 4]
    torch.testing.assert_close(folded, gathered.attend(0, q, 0.25, 1), atol=1e-5, rtol=0)
    gathered_alone = cross_module.CrossStep(cache, [(i, [s], 1) for i, s in enumerate(rows)], torch.float32)
    torch.testing.assert_close(gathered.attend(0, q, 0.25, 1), gathered_alone.attend(0, q, 0.25, 1), atol=1e-6, rtol=0)


@pytest.mark.skipif(not __import__("fastdecode.layers.ops", fromlist=["available"]).available(),
                    reason="no C++ extension")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [16, 12, 5])
def test_paged_cross_attention_op_is_the_contiguous_op_bitwise(dtype, block):
    """layers/cross_attention.cpp: sources in scattered blocks [blocks, H, block, D] (block sizes that
    are and are not a multiple of its 8-key step) give the bits of the same sources contiguous
    [B, H, S, D] (float32 and float16 K/V), lengths that end inside a block included."""
    from fastdecode.layers import ops

    generator = torch.Generator().manual_seed(block)
    B, H, T, D, lengths = 3, 2, 4, 24, [29, 7, 40]
    S = max(lengths)
    n = -(-S // block)
    keys = torch.randn(B, H, S, D, generator=generator).to(dtype)
    values = torch.randn(B, H, S, D, generator=generator).to(dtype)
    q = torch.randn(B, T, H, D, generator=generator).transpose(1, 2)  # [B, H, T, D], D contiguous
    order = torch.randperm(B * n, generator=generator)  # block i of row b -> block order[b * n + i]
    pool_k = torch.zeros(B * n, H, block, D, dtype=dtype)
    pool_v = torch.zeros_like(pool_k)
    padded = n * block
    for b in range(B):
        for source, pool in ((keys, pool_k), (values, pool_v)):
            rows = torch.cat([source[b], source.new_zeros(H, padded - S, D)], dim=1) if padded > S else source[b]
            pool[order[b * n : (b + 1) * n]] = rows[:, :padded].unflatten(1, (n, block)).transpose(0, 1)
    table = order.view(B, n).contiguous()
    length = torch.tensor(lengths)
    contiguous = ops.cross_attention(q, keys.contiguous(), values.contiguous(), length, 0.3, 1)
    for threads in (1, 2):
        paged = ops.paged_cross_attention(q, pool_k, pool_v, table, length, 0.3, threads)
        assert torch.equal(paged, contiguous)
    with pytest.raises(RuntimeError, match="outside"):
        ops.paged_cross_attention(q, pool_k, pool_v, table + B * n, length, 0.3, 1)
