"""The layered slot cache (engine/slots.py): sliding-window layers keep only the blocks their
window can still see, full layers keep everything. On a tiny Gemma 3 (sliding layers around a
full one, window 12, blocks of 4 tokens, sequences several windows long): transformers' tokens and
log-probabilities, sliding blocks bounded while the full ones grow, batched == alone, beams, the
prefix cache's exact rule, chat turns, cancellation, and the memory estimates."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine import Engine
from fastdecode.engine.slots import SlotCache
from fastdecode.memory import check_request_memory, request_parts, sequence_kv_bytes
from engine_helpers import run_arrivals
from tiny_models import VOCAB, build_gemma3, hf_greedy

pytest.importorskip("transformers")

WINDOW, BLOCK, CHUNK = 12, 4, 8


@pytest.fixture(scope="module")
def gemma():
    hf = build_gemma3(seed=3, sliding_window=WINDOW)
    return hf, fastdecode.from_hf(hf)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(gen, **options):
    return Engine(gen.model, gen.requests, block_size=BLOCK, prefill_chunk=CHUNK, **options)


def _cold(gen, prompt: list[int], new: int) -> list[int]:
    return run_arrivals(_engine(gen), {0: [(prompt, {"max_new_tokens": new})]})[0]


def _all_free(engine) -> bool:
    pools = [engine.cache.pool, *engine.cache.window_pools.values()]
    return all(p.num_used == 0 for p in pools) and all(p.reserved == 0 for p in pools[1:])


def test_greedy_equals_transformers_while_sliding_blocks_stay_bounded(gemma):
    hf, gen = gemma
    prompt, new = _prompt(20, 1), 34
    engine = _engine(gen)
    sequence = engine.submit(prompt, {"max_new_tokens": new, "logprobs": 0})
    sliding, full = engine.cache.window_pools[WINDOW], engine.cache.pool
    held, logprobs = [], []
    while engine.has_work():
        logprobs += [event.logprob for event in engine.step()]
        held.append((full.num_used, sliding.num_used))
    assert sequence.output_ids == hf_greedy(hf, prompt, new)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + sequence.output_ids])).logits[0, len(prompt) - 1 : -1]  # [new, V]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(sequence.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
    decoding = held[3:-1]  # the prompt reads in 3 chunks of <= 8; the last step has released everything
    assert {f for f, _ in decoding} == {(20 + new) // BLOCK + 1}  # the full kind: the whole request
    assert max(s for _, s in held) <= engine.cache.reservation(WINDOW, 20 + new, CHUNK) == 6
    assert max(s for _, s in decoding) == (WINDOW - 1) // BLOCK + 2 == 4  # only the window, whatever the context
    assert _all_free(engine)


def test_batched_with_joins_equals_alone_and_transformers(gemma):
    hf, gen = gemma
    requests = [(_prompt(n, n), {"max_new_tokens": new}) for n, new in [(13, 30), (25, 18), (5, 26), (40, 10)]]
    arrivals = {0: requests[:1], 3: requests[1:2], 7: requests[2:]}
    engine = _engine(gen, max_batch_tokens=16)
    together = run_arrivals(engine, arrivals)
    assert together == [_cold(gen, p, o["max_new_tokens"]) for p, o in requests]
    assert together == [hf_greedy(hf, p, o["max_new_tokens"]) for p, o in requests]
    assert _all_free(engine)


def test_beam_search_equals_transformers_past_the_window(gemma):
    hf, gen = gemma
    prompts = [_prompt(20, 4), _prompt(9, 5)]
    options = dict(num_beams=3, max_new_tokens=30, num_return_sequences=2, early_stopping=True, length_penalty=1.0)
    ours = gen.generate_ids(prompts, **options)
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              do_sample=False, **options)
        assert ours[2 * index : 2 * index + 2] == [row[len(prompt):].tolist() for row in out]


def test_prefix_cache_hit_is_exact_and_refused_when_the_window_is_gone(gemma):
    _, gen = gemma
    prefix = _prompt(40, 6)
    first, second, third = prefix + [3, 4], prefix + _prompt(5, 7), prefix + _prompt(3, 8)
    engine = _engine(gen)
    run_arrivals(engine, {0: [(first, {"max_new_tokens": 20})]})  # slides well past the prefix
    later = engine.submit(second, {"max_new_tokens": 16})
    while engine.has_work():
        engine.step()
    assert later.num_cached_prompt_tokens == 40  # the full blocks, and the sliding ones of its last window
    assert later.output_ids == _cold(gen, second, 16)
    sliding = engine.cache.window_pools[WINDOW]
    sliding.release(sliding.take(sliding.num_free))  # every free sliding block reused: their names are gone
    assert engine.cache.pool.cached_prefix(third)  # the full layers still hold the prefix...
    refused = engine.submit(third, {"max_new_tokens": 16})
    while engine.has_work():
        engine.step()
    assert refused.num_cached_prompt_tokens == 0  # ...but without the window's K/V a hit would not be exact
    assert refused.output_ids == _cold(gen, third, 16)
    assert _all_free(engine)


def test_a_hit_is_cut_back_to_where_every_window_is_present():
    cache = SlotCache(2, 32, 1, 4, torch.float32, torch.device("cpu"), BLOCK, layer_windows=[WINDOW, None])
    prompt = list(range(2, 42))  # 40 tokens: 10 blocks
    table, _ = cache.allocate(prompt, 44, CHUNK)
    hashes: list[int] = []
    for start in range(0, 40, CHUNK):
        cache.prepare(table, start, start + CHUNK)
        cache.publish(table, prompt, hashes, (start + CHUNK) // BLOCK)
    assert table.windows[WINDOW][:5] == [-1] * 5  # slid out: queries from 32 on see positions 21 and later
    cache.release(table)
    blocks = table.windows[WINDOW]
    sliding = cache.window_pools[WINDOW]
    assert len(cache.cached_prefix(prompt + [7])) == 10  # blocks 7..9 (the last window) are still named
    sliding._forget(blocks[9])  # a hit of 10 blocks needs 7..9, one of 9 needs 6..8
    assert len(cache.cached_prefix(prompt + [7])) == 9
    sliding._forget(blocks[6])  # 8 blocks need 5..7, 7 need 4..6, 6 need 3..5 (named before they slid out)
    hit = cache.cached_prefix(prompt + [7])
    assert len(hit) == 6 and hit.windows[WINDOW][:3] == [-1] * 3 and -1 not in hit.windows[WINDOW][3:]
    assert cache.can_allocate(prompt + [7], 44, CHUNK)


def test_a_chat_turn_keeps_its_window_and_equals_a_cold_run(gemma):
    _, gen = gemma
    engine = _engine(gen)
    config = gen.requests.generation_config({"max_new_tokens": 14})
    turn = engine.add(gen.requests.request(_prompt(30, 9), config, None), keep=True)
    while engine.has_work():
        engine.step()
    reply = engine.resume(turn, gen.requests.request([5, 6, 7], config, None))
    while engine.has_work():
        engine.step()
    conversation = turn.prompt_ids + turn.output_ids + [5, 6, 7]
    assert reply.num_cached_prompt_tokens == len(conversation) - 4  # only the last token and the new ones run
    assert reply.output_ids == _cold(gen, conversation, 14)
    engine.drop(reply)
    assert _all_free(engine)


def test_cancellation_frees_every_kind(gemma):
    _, gen = gemma
    engine = _engine(gen)
    keep = engine.submit(_prompt(20, 10), {"max_new_tokens": 30})
    drop = engine.submit(_prompt(30, 11), {"max_new_tokens": 30})
    for _ in range(6):
        engine.step()
    assert engine.cache.window_pools[WINDOW].num_used > 0
    drop.cancel()
    engine.step()
    assert drop.finish_reason == "cancelled"
    keep.cancel()
    engine.step()
    assert _all_free(engine) and not engine.has_work()


def test_inspect_and_memory_estimates_count_each_kind(gemma):
    _, gen = gemma
    cfg = gen.config
    per_kind = cfg.kv_bytes_per_token_by_kind(4)  # {"full_attention": 1 layer, "sliding_attention": 3 layers}
    info = gen.inspect()
    assert info["kv_cache_bytes_per_token_by_kind"] == per_kind
    by_context = info["kv_cache_bytes_per_sequence_by_context"]
    assert list(by_context) == [cfg.max_position_embeddings]
    long = sequence_kv_bytes(cfg, 8192, 4)
    sliding_tokens = WINDOW + 256 + 32  # window + the engine's chunk + two partial blocks
    assert long == per_kind["full_attention"] * 8192 + per_kind["sliding_attention"] * sliding_tokens
    assert sequence_kv_bytes(cfg, 8192, 4) - sequence_kv_bytes(cfg, 4096, 4) == per_kind["full_attention"] * 4096
    config = gen.requests.generation_config({"max_new_tokens": 10})
    assert request_parts(cfg, config, [30], 4)["KV cache"] == sequence_kv_bytes(cfg, 40, 4)
    assert check_request_memory(cfg, config, [30], 4) > 0


def test_a_cache_without_kinds_still_masks_each_layers_window(gemma):
    """A strategy may keep every layer in full (a cache built without ``layer_windows``): the plan
    stores by the cache's kinds and masks by the model's windows."""
    from fastdecode.engine.plan import StepPlan, attention_terms
    from fastdecode.layers.products import Products

    hf, gen = gemma
    model, prompt = gen.model, _prompt(30, 12)
    cfg = model.config
    cache = SlotCache(cfg.num_layers, 8, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu"), BLOCK)
    windows, bias = attention_terms(model)
    table = cache.take(len(prompt))
    plan = StepPlan.for_rows(cache, [(table, 0, len(prompt))], windows, bias, torch.float32,
                             Products.generated(torch.get_num_threads(), kernels=model.kernels))
    with torch.inference_mode():
        ours = model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], plan, all_logits=True)
        expected = hf(torch.tensor([prompt])).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)
