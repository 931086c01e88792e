"""Many clients at once, disconnects, multi-turn reuse and conversations past the context."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_helpers import chat_generator, serve, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

SYSTEM = ("You are a helpful assistant. Answer in one short sentence, politely, and never repeat the question. "
          "Numbers like 12, 345 and 6789 appear here.")


def test_32_concurrent_streaming_clients_each_get_their_offline_result(server, chat_generator):
    """Greedy and seeded-sampling streams interleave in the engine; none is lost or mixed up."""
    prompts = [f"Question {i}: " + ["Hello there", "A cat sat", "The capital of France"][i % 3] for i in range(32)]
    settings = [dict(temperature=0) if i % 2 == 0 else dict(temperature=0.8, seed=i) for i in range(32)]
    lengths = [4 + i % 5 for i in range(32)]

    async def one(client, i):
        text = ""
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompts[i]}], max_tokens=lengths[i], stream=True,
            **settings[i])
        async for chunk in stream:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        return text

    async def all_clients():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    texts = asyncio.run(all_clients())
    for i, text in enumerate(texts):
        sampled = dict(do_sample=True, temperature=0.8, seed=i) if i % 2 else {}
        expected = chat_generator.generate([{"role": "user", "content": prompts[i]}], max_new_tokens=lengths[i],
                                           **sampled)
        assert text == expected, f"client {i}"


def test_disconnect_mid_stream_frees_the_sequence(server):
    service = server.service
    generated = service.metrics.generated_tokens._value.get()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
    deadline = time.monotonic() + 10
    while service.active_sequences() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert service.active_sequences() == 0
    assert service.metrics.generated_tokens._value.get() - generated < 200  # cancelled, not run to the end
    assert server.http.get("/health").json()["running_sequences"] == 0


def test_multi_turn_reuses_the_prefix_cache(server):
    """Turn 2 carries turn 1 whole: the engine's prefix cache serves it, the model runs only the rest."""
    client = server.client()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there"}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And then?"}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens // 2


def test_conversation_past_the_context_goes_on_through_the_streaming_cache(chat_generator):
    """--n-ctx 48: every turn outgrows the context; turn N continues the kept streaming cache and
    feeds only its new tokens. With --context-overflow error the same request is a 400."""
    with serve(chat_generator, n_ctx=48, n_keep=4, context_overflow="shift") as running:
        client = running.client()
        messages = [{"role": "user", "content": "Hello there"}]
        first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0)
        prompt = chat_generator.encode_prompt(messages)
        offline = chat_generator.generate_ids([prompt], max_new_tokens=40, n_ctx=48, n_keep=4, policy="shift")[0]
        assert first.choices[0].message.content == chat_generator.tokenizer.decode(offline)
        reply = first.choices[0].message.content
        for turn in range(3):
            messages += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": f"Go on, part {turn}"}]
            chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
            assert usage.completion_tokens == 40 or chunks[-2].choices[0].finish_reason == "stop"
            cached = usage.prompt_tokens_details.cached_tokens
            assert cached > 48  # the conversation so far, longer than the context, was kept
            assert usage.prompt_tokens - cached < 40  # the model ran only this turn's new tokens
    with serve(chat_generator, n_ctx=48, context_overflow="error") as running:
        with pytest.raises(openai.BadRequestError, match="context") as info:
            running.client().chat.completions.create(model="tiny", messages=messages, max_tokens=40)
        assert info.value.body["code"] == "context_length_exceeded"
