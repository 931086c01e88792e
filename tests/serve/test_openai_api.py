"""The OpenAI API through the official `openai` client: every answer equals offline generation.

For each case: the streamed concatenation == the non-streamed text == ``Generator.generate`` with
the same options (the OpenAI fields mapped onto fastdecode's: temperature 0 -> greedy, max_tokens
-> max_new_tokens, seed of choice j -> seed + j).
"""

from __future__ import annotations

import pytest

from serve_helpers import (chat_generator, serve, server, tiny_bart_generator, tiny_chat_generator,  # noqa: F401
                           tiny_family_generator)

openai = pytest.importorskip("openai")

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def completion_texts(client, stream: bool, **request) -> list[str]:
    if not stream:
        response = client.completions.create(model="tiny", **request)
        return [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model="tiny", stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    return [texts[i] for i in sorted(texts)]


def chat_texts(client, stream: bool, **request) -> list[str]:
    if not stream:
        response = client.chat.completions.create(model="tiny", **request)
        return [c.message.content for c in sorted(response.choices, key=lambda c: c.index)]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="tiny", stream=True, **request):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return [texts[i] for i in sorted(texts)]


def test_completion_greedy_streamed_equals_whole_equals_offline(server, chat_generator):
    client = server.client()
    offline = chat_generator.generate("Hello there", max_new_tokens=12)
    for stream in (False, True):
        assert completion_texts(client, stream, prompt="Hello there", max_tokens=12, temperature=0) == [offline]
    # a batch of prompts (strings and token ids) keeps its order
    ids = chat_generator.tokenizer.encode("A cat sat")
    expected = chat_generator.generate(["A cat sat", "Hello there"], max_new_tokens=12)
    assert completion_texts(client, True, prompt=[ids, chat_generator.tokenizer.encode("Hello there")],
                            max_tokens=12, temperature=0) == expected


def test_chat_greedy_and_usage(server, chat_generator):
    client = server.client()
    offline = chat_generator.generate(QUESTION, max_new_tokens=10)
    response = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0)
    assert response.choices[0].message.content == offline
    assert response.choices[0].finish_reason == "length"
    prompt_tokens = len(chat_generator.encode_prompt(QUESTION))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, 10)
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == offline
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_sampling_n_and_seed_reproducible(server, chat_generator):
    client = server.client()
    request = dict(messages=QUESTION, max_tokens=8, temperature=0.9, top_p=0.95, n=3, seed=11,
                   extra_body={"top_k": 40})
    whole = chat_texts(client, False, **request)
    assert chat_texts(client, True, **request) == whole == chat_texts(client, False, **request)
    offline = [chat_generator.generate(QUESTION, max_new_tokens=8, do_sample=True, temperature=0.9, top_p=0.95,
                                       top_k=40, seed=11 + j) for j in range(3)]
    assert whole == offline
    assert len(set(whole)) > 1  # the choices are different samples


def test_stop_strings_and_extras(server, chat_generator):
    client = server.client()
    full = chat_generator.generate("Hello there", max_new_tokens=16)
    stop = full[3:5]  # a stop string the greedy continuation certainly contains
    options = dict(max_new_tokens=16, stop=[stop], repetition_penalty=1.3, no_repeat_ngram_size=2, min_new_tokens=2)
    offline = chat_generator.generate("Hello there", **options)
    request = dict(prompt="Hello there", max_tokens=16, temperature=0, stop=[stop],
                   extra_body={"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "min_tokens": 2})
    for stream in (False, True):
        assert completion_texts(client, stream, **request) == [offline]
    response = client.completions.create(model="tiny", prompt="Hello there", max_tokens=16, temperature=0, stop=stop)
    assert response.choices[0].text == chat_generator.generate("Hello there", max_new_tokens=16, stop=stop)
    assert response.choices[0].finish_reason == "stop" and stop not in response.choices[0].text


def test_logprobs_are_the_models(server, chat_generator):
    """Chosen-token logprobs equal -NLL from Generator.score of prompt + output (raw logits)."""
    client = server.client()
    response = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, temperature=0,
                                         logprobs=3)
    logprobs = response.choices[0].logprobs
    prompt = chat_generator.tokenizer.encode("Hello there")
    output = chat_generator.generate_ids([prompt], max_new_tokens=6)[0]
    nll = chat_generator.score(prompt + output)[-len(output):]
    assert logprobs.token_logprobs == pytest.approx([-x for x in nll], abs=1e-4)
    assert all(len(top) <= 3 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs))
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)
    assert entries[0].top_logprobs[0].logprob == pytest.approx(entries[0].logprob)  # greedy: the best token


def test_text_offsets_count_split_characters_once(server, chat_generator):
    """echo + logprobs (how harnesses score a text): each token's text_offset points at it in the text, also
    after characters split over byte tokens (each piece's U+FFFD was counted as a character)."""
    prompt = "Numbers like café 12, crème 345"
    ids = chat_generator.tokenizer.encode(prompt)
    assert any(chat_generator.tokenizer.decode([i]) == "\ufffd" for i in ids)  # é and è are split
    choice = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True,
                                                logprobs=0).choices[0]
    logprobs = choice.logprobs
    assert choice.text == prompt and len(logprobs.text_offset) == len(ids)
    assert all(prompt[offset:].startswith(token) for token, offset in zip(logprobs.tokens, logprobs.text_offset)
               if "\ufffd" not in token)


def test_streamed_text_offsets_go_on_across_chunks(server):
    """A streamed completion's text_offset is each token's place in the whole text (its prompt first with
    echo), as in the same request's whole answer: each chunk's offsets go on from the last, not from 0."""
    client = server.client()
    for echo in (False, True):
        request = dict(model="tiny", prompt="Numbers like café 12", max_tokens=6, temperature=0, n=2, echo=echo,
                       logprobs=1)
        whole = client.completions.create(**request)
        streamed: dict[int, list[int]] = {}
        for chunk in client.completions.create(stream=True, **request):
            for choice in chunk.choices:
                streamed.setdefault(choice.index, []).extend(choice.logprobs.text_offset if choice.logprobs else [])
        for choice in whole.choices:
            assert streamed[choice.index] == choice.logprobs.text_offset
            assert len(set(choice.logprobs.text_offset)) > 1


def test_logprob_bytes_are_the_tokens_own_also_within_a_character(server, chat_generator):
    """A byte-level token holding the first byte of "é" reads as U+FFFD alone; its ``bytes`` are still
    its own byte (0xC3), so that the bytes of the tokens join into the text (OpenAI's ``bytes``)."""
    lead = chat_generator.tokenizer.token_to_id(chr(0xC3))  # byte 0xC3 is the printable "Ã" in GPT-2's table
    assert chat_generator.tokenizer.decode([lead]) == "\ufffd"
    response = server.client().chat.completions.create(model="tiny", messages=QUESTION, max_tokens=3, temperature=0,
                                                       logprobs=True, top_logprobs=1, logit_bias={str(lead): 100})
    entries = response.choices[0].logprobs.content
    assert [e.bytes for e in entries] == [[0xC3]] * 3
    assert all(bytes(top.bytes).decode("utf-8", "replace") == top.token for e in entries for top in e.top_logprobs)


def test_beam_search(server, chat_generator):
    client = server.client()
    options = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, length_penalty=0.8)
    offline = chat_generator.generate("Hello there", **options)
    request = dict(prompt="Hello there", max_tokens=8, n=2, extra_body={"num_beams": 3, "length_penalty": 0.8})
    for stream in (False, True):
        assert completion_texts(client, stream, **request) == offline
    response = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, n=1,
                                              extra_body={"num_beams": 2})
    assert response.choices[0].message.content == chat_generator.generate(QUESTION, max_new_tokens=6, num_beams=2)
    assert response.usage.completion_tokens > 0


def test_encoder_decoder_model():
    bart = tiny_bart_generator()
    source = "The capital of France is Paris."
    with serve(bart) as server:
        client = server.client()
        offline = bart.generate(source, max_new_tokens=10)
        for stream in (False, True):
            assert completion_texts(client, stream, prompt=source, max_tokens=10, temperature=0) == [offline]
        beams = bart.generate(source, max_new_tokens=10, num_beams=3)
        assert completion_texts(client, False, prompt=source, max_tokens=10, extra_body={"num_beams": 3}) == [beams]
        with pytest.raises(openai.BadRequestError, match="encoder-decoder"):
            client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)


def test_quantized_model_served_equals_offline():
    """int8 weights behind the server: greedy (streamed and whole), seeded sampling and beam search answer as
    the same quantized Generator does offline (the n = 2 samples decoded together)."""
    quantized = tiny_chat_generator(quantize="int8")
    with serve(quantized) as server:
        client = server.client()
        for stream in (False, True):
            assert completion_texts(client, stream, prompt="Hello there", max_tokens=12, temperature=0) == [
                quantized.generate("Hello there", max_new_tokens=12)]
        sampled = completion_texts(client, False, prompt="A cat", max_tokens=8, temperature=1.0, n=2, seed=5)
        assert sampled == [quantized.generate("A cat", max_new_tokens=8, do_sample=True, temperature=1.0, seed=5 + j)
                           for j in range(2)]
        response = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6,
                                                  extra_body={"num_beams": 2})
        assert response.choices[0].message.content == quantized.generate(QUESTION, max_new_tokens=6, num_beams=2)


def test_qwen3_granite_smollm3_olmo2_served_equal_offline():
    """Qwen3, Granite, SmolLM3 and OLMo 2 behind the server answer as offline (greedy, whole and streamed)."""
    for family in ("qwen3", "granite", "smollm3", "olmo2"):
        generator = tiny_chat_generator(seed=3, family=family)
        offline = generator.generate("Hello there", max_new_tokens=10)
        with serve(generator) as server:
            client = server.client()
            for stream in (False, True):
                served = completion_texts(client, stream, prompt="Hello there", max_tokens=10, temperature=0)
                assert served == [offline], family


@pytest.mark.parametrize("kind", ["phi3-longrope", "gemma2"])
def test_new_families_served_equal_offline(kind):
    """Phi-3 (fused products, LongRoPE) and Gemma 2 (soft-capped attention) behind the server:
    completions streamed and whole, and a chat answer, equal offline generation."""
    generator = tiny_family_generator(kind)
    with serve(generator) as running:
        client = running.client()
        for stream in (False, True):
            assert completion_texts(client, stream, prompt="Hello there", max_tokens=10, temperature=0) == [
                generator.generate("Hello there", max_new_tokens=10)]
        assert chat_texts(client, False, messages=QUESTION, max_tokens=8, temperature=0) == [
            generator.generate(QUESTION, max_new_tokens=8)]
