"""Streams past n_ctx as sequences of the one engine: several streams (shift and re-evaluate, each
with its own n_ctx / n_keep / n_discard) arriving at random steps beside greedy requests each
give the tokens of the same request alone and of a stream alone on its own cache
(tests/stream_alone.py); a stream cancelled mid-way frees every block."""

from __future__ import annotations

import random

import pytest
import torch

import fastdecode
from stream_alone import stream_alone
from tiny_models import VOCAB, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama-gqa", "gemma3", "bloom"])
def gen(request):
    torch.set_num_threads(1)
    return fastdecode.from_hf(build(request.param))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stream_alone(gen, prompt: list[int], options: dict) -> list[int]:
    """Greedy on a stream of its own cache, token by token after the prompt."""
    config = gen.requests.generation_config(options)
    stream, out = stream_alone(gen.model, config), []
    with torch.inference_mode():
        logits = stream.feed(torch.tensor(prompt))
        for _ in range(config.max_new_tokens):
            out.append(int(logits.argmax()))
            logits = stream.feed(torch.tensor(out[-1:]))
    return out


def _run_alone(gen, prompt: list[int], options: dict) -> list[int]:
    engine = gen.engine()
    sequence = engine.submit(prompt, options)
    while engine.has_work():
        engine.step()
    return sequence.output_ids


REQUESTS = [  # (prompt length, options): streams past n_ctx and plain greedy requests
    (30, {"n_ctx": 20, "n_keep": 3, "policy": "shift", "max_new_tokens": 25}),
    (6, {"n_ctx": 24, "n_keep": 4, "n_discard": 5, "policy": "shift", "max_new_tokens": 40}),
    (12, {"max_new_tokens": 12}),
    (25, {"n_ctx": 20, "n_keep": 2, "policy": "reevaluate", "max_new_tokens": 20}),
    (9, {"max_new_tokens": 20}),
    (40, {"n_ctx": 16, "n_keep": 0, "n_discard": 1, "policy": "shift", "max_new_tokens": 15}),
]


def test_streams_at_random_steps_equal_each_request_alone(gen):
    prompts = [_prompt(n, seed) for seed, (n, _) in enumerate(REQUESTS)]
    rng = random.Random(5)
    arrivals = sorted(rng.randrange(0, 12) for _ in REQUESTS)
    engine, sequences, step = gen.engine(max_batch_tokens=64, prefill_chunk=16), {}, 0
    while len(sequences) < len(REQUESTS) or engine.has_work():
        for index, at in enumerate(arrivals):
            if at == step:
                sequences[index] = engine.submit(prompts[index], REQUESTS[index][1])
        engine.step()
        step += 1
    for index, (_, options) in enumerate(REQUESTS):
        alone = _run_alone(gen, prompts[index], options)
        assert sequences[index].output_ids == alone, index
        if "n_ctx" in options:
            assert alone == _stream_alone(gen, prompts[index], options), index
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert all(pool.reserved == 0 and pool.num_used == 0 for pool in engine.cache.window_pools.values())


@pytest.mark.parametrize("policy", ["shift", "reevaluate"])
def test_a_stream_cancelled_mid_way_frees_every_block(gen, policy):
    engine = gen.engine(max_batch_tokens=32, prefill_chunk=8)
    stream = engine.submit(_prompt(30, 1), {"n_ctx": 20, "n_keep": 3, "policy": policy, "max_new_tokens": None})
    other = engine.submit(_prompt(8, 2), {"max_new_tokens": 30})
    for _ in range(25):  # well past n_ctx: drops (and re-evaluations or compactions) happened
        engine.step()
    assert stream.num_computed > 20 and not stream.finished
    stream.cancel()
    while engine.has_work():
        engine.step()
    assert stream.finish_reason == "cancelled" and other.finish_reason == "length"
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert all(pool.reserved == 0 and pool.num_used == 0 for pool in engine.cache.window_pools.values())


def test_a_stream_the_cache_can_never_hold_is_refused(gen):
    from fastdecode.errors import PromptTooLongError

    engine = gen.engine(cache_tokens=64)
    with pytest.raises(PromptTooLongError, match="n_ctx=100"):
        engine.submit(_prompt(5, 1), {"n_ctx": 100, "max_new_tokens": 4})


def test_kept_streams_resume_a_continued_conversation_and_give_way_to_waiting_requests(gen):
    """The server's conversations past the context (serve/kept_streams.py): a request continuing a
    kept stream resumes it (only the new tokens run); a request that waits for the blocks the kept
    streams hold gets them."""
    from fastdecode.serve.kept_streams import KeptStreams

    engine = gen.engine(cache_tokens=64)  # 4 blocks: one stream of n_ctx 20 (40 slots with headroom) takes 3
    streams = KeptStreams(gen, {"n_ctx": 20, "n_keep": 3, "policy": "shift"})
    first = streams.submit(engine, _prompt(30, 1), None, {"max_new_tokens": 5})
    while engine.has_work():
        engine.step()
    streams.finished(engine, first, None)
    held = first.tokens(0, first.num_tokens)
    second = streams.submit(engine, held + [5, 6, 7], None, {"max_new_tokens": 5})
    run_before = engine.tokens_run
    while engine.has_work():
        engine.step()
    assert second.num_cached_prompt_tokens == first.num_computed == len(held) - 1
    assert engine.tokens_run - run_before == 1 + 3 + 4  # the last reply token, the new ones, the reply
    streams.finished(engine, second, None)
    waiting = engine.submit(_prompt(8, 2), {"max_new_tokens": 40})  # 3 blocks: only 1 is free
    engine.step()
    assert waiting.num_computed == 0
    streams.make_room(engine)
    while engine.has_work():
        engine.step()
    assert waiting.finish_reason == "length"
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_decoding_streams_attend_together_as_each_would_alone(gen, monkeypatch):
    """Streams decoding one token in one frame (before and after their context filled: keys before
    the sinks hidden) attend in one paged op, each row equal to its own plan's attention."""
    from fastdecode.engine.stream_plan import MixedPlan

    batched, checked = MixedPlan._attend_paged, []

    def compared(self, layer, q, scale):
        together = batched(self, layer, q, scale)
        for index in self.paged:
            start = self.starts[index]
            alone = self.streams[index].attend_written(layer, q[:, :, start : start + 1], scale)
            torch.testing.assert_close(together[index], alone, atol=1e-5, rtol=0)
            checked.append((len(self.paged), self.streams[index].offset))
        return together

    monkeypatch.setattr(MixedPlan, "_attend_paged", compared)
    engine = gen.engine(max_batch_tokens=64, prefill_chunk=16)
    for n, options in REQUESTS:
        if "n_ctx" in options:
            engine.submit(_prompt(n, n), options)
    while engine.has_work():
        engine.step()
    if gen.model.dtype != torch.float32 or not fastdecode.layers.ops.available():
        return  # the paged op runs float32 on the CPU with the kernels built
    assert max(count for count, _ in checked) > 1  # several streams in one op
    assert any(offset > 0 for _, offset in checked)  # a row whose blocks hold keys before its sinks


def test_a_streams_one_token_prompt_chunk_has_the_whole_prompts_bits(smollm):
    """A stream's prompt token that runs alone (a chunk the stream's chunking leaves one token long; here
    a kept stream resumed with only its pending token) is a prompt row and attends as the prompt's other
    chunks do. It took the decoding streams' paged op, and the logprobs after the same text moved by
    roundings (as engine/plan.py's one-token prompt chunks did before 5392bda)."""
    import dataclasses

    tokenizer = smollm.tokenizer
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say 2"}],
                                                            add_generation_prompt=True), add_special_tokens=False)
    engine, streaming = smollm.engine(), {"n_ctx": 128, "n_keep": 4}
    answer = {**streaming, "max_new_tokens": 4, "logprobs": 0}

    def run(sequence) -> list[tuple[int, float]]:
        events = []
        while engine.has_work():
            events += [(e.token_id, e.logprob) for e in engine.step() if e.sequence is sequence]
        return events

    kept = engine.submit(prompt, {**streaming, "max_new_tokens": 1}, keep=True)
    run(kept)
    held = kept.tokens(0, kept.num_tokens)  # the prompt and its reply token, which the resume feeds alone
    resumed = engine.resume(kept, dataclasses.replace(engine.requests.build(held, answer), prompt=[]))
    split = run(resumed)
    assert resumed.num_cached_prompt_tokens == len(held) - 1 == len(prompt)
    assert split == run(engine.submit(held, answer))
