"""Every request field is served or refused: OpenAI's sampling fields (logit_bias, presence /
frequency penalties, best_of, seed -1, echo, suffix) and vLLM's (min_p, ignore_eos,
use_beam_search) change the output as specified, through the `openai` client on a real server;
every other field of OpenAI's request schemas is a 400 naming it."""

from __future__ import annotations

import typing

import pytest

from serve_helpers import chat_generator, serve, server, tiny_chat_generator  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

PROMPT = "The capital of France"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def complete(server, **request):
    return server.client().completions.create(model="tiny", prompt=request.pop("prompt", PROMPT), **request)


def test_logit_bias_changes_the_output(server, chat_generator):
    tokenizer = chat_generator.tokenizer
    plain = chat_generator.generate(PROMPT, max_new_tokens=6)
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    banned = chat_generator.generate_ids([chat_generator.encode_prompt(PROMPT)], max_new_tokens=1)[0][0]
    response = complete(server, max_tokens=6, temperature=0, logit_bias={str(forced): 100}, logprobs=0)
    assert response.choices[0].logprobs.tokens == [tokenizer.decode([forced], skip_special_tokens=False)] * 6
    response = complete(server, max_tokens=6, temperature=0, logit_bias={str(banned): -100})
    expected = chat_generator.generate(PROMPT, max_new_tokens=6, logit_bias={banned: -100.0})
    assert response.choices[0].text == expected != plain
    chat = server.client().chat.completions.create(model="tiny", messages=QUESTION, max_tokens=6, temperature=0,
                                                   logit_bias={str(banned): -100})
    assert chat.choices[0].message.content == chat_generator.generate(QUESTION, max_new_tokens=6,
                                                                      logit_bias={banned: -100.0})
    for bad in ({"x": 1}, {"5": 101}, {"99999": 1}):
        with pytest.raises(openai.BadRequestError) as caught:
            complete(server, max_tokens=2, logit_bias=bad)
        assert caught.value.body["param"] == "logit_bias"


def test_sampling_fields_of_a_greedy_request_change_nothing(server, chat_generator):
    """temperature 0 is OpenAI's greedy: its top_p / top_k / min_p ask nothing of it and are dropped
    (the Python API refuses them without do_sample); the answer is the greedy one, not a 400."""
    greedy = chat_generator.generate(PROMPT, max_new_tokens=6)
    response = complete(server, max_tokens=6, temperature=0, top_p=0.5, extra_body={"top_k": 3, "min_p": 0.5})
    assert response.choices[0].text == greedy


def test_presence_and_frequency_penalties(server, chat_generator):
    prompt = "A cat sat"  # its greedy continuation repeats itself
    plain = chat_generator.generate(prompt, max_new_tokens=16)
    expected = chat_generator.generate(prompt, max_new_tokens=16, presence_penalty=2.0, frequency_penalty=1.0)
    assert expected != plain
    response = complete(server, prompt=prompt, max_tokens=16, temperature=0, presence_penalty=2.0,
                        frequency_penalty=1.0)
    assert response.choices[0].text == expected


def test_min_p_and_ignore_eos(server, chat_generator):
    greedy = chat_generator.generate(PROMPT, max_new_tokens=8)
    # min_p = 1 keeps only the most likely token: sampling becomes greedy
    response = complete(server, max_tokens=8, temperature=1.0, seed=5, extra_body={"min_p": 1.0})
    assert response.choices[0].text == greedy
    sampled = chat_generator.generate(PROMPT, max_new_tokens=8, do_sample=True, seed=5, min_p=0.2)
    assert complete(server, max_tokens=8, temperature=1.0, seed=5, extra_body={"min_p": 0.2}).choices[0].text == sampled
    eos = chat_generator.tokenizer.token_to_id("<|im_end|>")
    ended = complete(server, max_tokens=5, temperature=0, logit_bias={str(eos): 100})
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens) == ("stop", 1)
    ignored = complete(server, max_tokens=5, temperature=0, logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 5)


def test_best_of_answers_the_best_candidates(server):
    candidates = complete(server, max_tokens=6, temperature=1.0, seed=11, n=4, logprobs=0)
    totals = {c.text: sum(c.logprobs.token_logprobs) for c in candidates.choices}
    best = sorted(totals, key=lambda text: -totals[text])
    response = complete(server, max_tokens=6, temperature=1.0, seed=11, n=2, best_of=4)
    assert [c.text for c in response.choices] == best[:2]
    assert [c.index for c in response.choices] == [0, 1] and response.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(server, max_tokens=2, temperature=1.0, n=3, best_of=2)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        complete(server, max_tokens=2, temperature=1.0, best_of=3, stream=True)


def test_seed_minus_one_is_random(server):
    texts = {complete(server, max_tokens=12, temperature=1.0, seed=-1).choices[0].text for _ in range(3)}
    assert len(texts) > 1


def test_use_beam_search_is_beam_search(server, chat_generator):
    expected = chat_generator.generate(PROMPT, max_new_tokens=6, num_beams=3)
    response = complete(server, max_tokens=6, temperature=0, best_of=3, extra_body={"use_beam_search": True})
    assert response.choices[0].text == expected
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, max_tokens=6, extra_body={"use_beam_search": True})
    assert caught.value.body["param"] == "use_beam_search"


def test_echo_with_logprobs_scores_the_prompt(server, chat_generator):
    ids = chat_generator.encode_prompt(PROMPT)
    nll = chat_generator.score(ids)
    response = complete(server, max_tokens=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx([-v for v in nll], abs=1e-5)
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    # echo + generation: the prompt, then the generated text (and its logprobs after the prompt's)
    generated = chat_generator.generate(PROMPT, max_new_tokens=5)
    whole = complete(server, max_tokens=5, temperature=0, echo=True, logprobs=0).choices[0]
    assert whole.text == PROMPT + generated and len(whole.logprobs.tokens) == len(ids) + 5
    streamed = "".join(chunk.choices[0].text for chunk in complete(server, max_tokens=5, temperature=0, echo=True,
                                                                  stream=True))
    assert streamed == PROMPT + generated
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        complete(server, max_tokens=0)


def test_suffix_fills_in_the_middle():
    gen = tiny_chat_generator(extra_specials=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    tokenizer = gen.tokenizer
    ids = ([tokenizer.token_to_id("<|fim_prefix|>")] + tokenizer.encode("def add(a, b):", add_special_tokens=False)
           + [tokenizer.token_to_id("<|fim_suffix|>")] + tokenizer.encode("\n", add_special_tokens=False)
           + [tokenizer.token_to_id("<|fim_middle|>")])
    expected = gen.decode_results(gen.generate_ids_with_details([ids], max_new_tokens=6))[0]
    with serve(gen) as running:
        response = complete(running, prompt="def add(a, b):", suffix="\n", max_tokens=6, temperature=0)
    assert response.choices[0].text == expected


def test_suffix_without_fim_tokens_is_refused(server):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(server, suffix="return x", max_tokens=2)
    assert caught.value.body["param"] == "suffix"


# -- every field of OpenAI's request schemas --------------------------------------------------------
# The fields fastdecode serves, each with the test above (or in test_openai_api.py) that shows its effect.
SERVED = {
    "model", "stream", "n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
    "logprobs", "top_logprobs", "stream_options", "messages", "prompt", "logit_bias", "presence_penalty",
    "frequency_penalty", "best_of", "echo", "suffix",
    # structured outputs and tool calls (issue 31's tests: test_structured_outputs.py, test_tool_calls.py)
    "response_format", "tools", "tool_choice", "parallel_tool_calls",
}
# Accepted because they carry no instruction about the output (identifiers, cache hints).
NO_EFFECT = {"user", "metadata", "safety_identifier", "prompt_cache_key"}
# Accepted only with the neutral value: (neutral, refused).
NEUTRAL = {"store": (False, True), "service_tier": ("auto", "flex"), "modalities": (["text"], ["text", "audio"])}
# The deprecated function-calling fields (tools replaced them): refused.
LATER = {"functions", "function_call"}


def schema_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_no_field_of_openai_request_schemas_is_silently_dropped(server, endpoint):
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    chat = endpoint == "chat/completions"
    fields = schema_fields(chat_create_params if chat else completion_create_params)
    base = {"model": "tiny", "max_tokens": 2, "temperature": 0}
    base.update({"messages": QUESTION} if chat else {"prompt": PROMPT})
    for name in sorted(fields - SERVED - NO_EFFECT):
        if name in NEUTRAL:
            neutral, refused = NEUTRAL[name]
            assert server.http.post(f"/v1/{endpoint}", json={**base, name: neutral}).status_code == 200, name
            value = refused
        else:
            value = {"type": "json_object"} if name == "response_format" else [{"some": "value"}]
        answer = server.http.post(f"/v1/{endpoint}", json={**base, name: value})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == name, (name, answer.text)
    for name in sorted(fields & NO_EFFECT):
        value = {"k": "v"} if name == "metadata" else "someone"
        assert server.http.post(f"/v1/{endpoint}", json={**base, name: value}).status_code == 200, name
    from fastdecode.serve import fields as server_fields

    assert fields & SERVED <= server_fields.SERVED["chat" if chat else "completion"]  # served = implemented
    assert not LATER & (SERVED | NO_EFFECT) and (LATER <= fields if chat else True)  # refused in the loop above


def test_unknown_fields_are_refused_unless_lenient(server, chat_generator):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "mirostat_tau": 5.0}
    answer = server.http.post("/v1/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mirostat_tau"
    assert "--lenient" in answer.json()["error"]["message"]
    echo_on_chat = server.http.post("/v1/chat/completions", json={"model": "tiny", "messages": QUESTION, "echo": True})
    assert echo_on_chat.status_code == 400 and "completion endpoint" in echo_on_chat.json()["error"]["message"]
    with serve(chat_generator, lenient=True) as running:
        assert running.http.post("/v1/completions", json=body).status_code == 200
        tools = running.http.post("/v1/completions", json={**body, "tools": [{"type": "function"}]})
        assert tools.status_code == 400  # a known field it cannot honour stays refused
        typo = {"model": "tiny", "messages": [{"role": "user", "content": "Hi", "nmae": "bob"}], "max_tokens": 2}
        assert running.http.post("/v1/chat/completions", json=typo).status_code == 200  # a message's too
    answer = server.http.post("/v1/chat/completions", json=typo)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[0].nmae"


def test_a_message_name_reaches_the_chat_template(chat_generator):
    """OpenAI's ``name`` of a participant is given to the template (as vLLM does), never dropped."""
    shows_names = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if m.name %} {{ m.name }}{% endif %}\n"
                   "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}")
    gen = tiny_chat_generator(chat_template=shows_names)
    named = [{"role": "user", "content": "Hi", "name": "Ada"}]
    expected = gen.generate(named, max_new_tokens=6)
    assert expected != gen.generate([{"role": "user", "content": "Hi"}], max_new_tokens=6)
    with serve(gen) as running:
        answer = running.client().chat.completions.create(model="tiny", messages=named, max_tokens=6, temperature=0)
    assert answer.choices[0].message.content == expected


def test_an_openai_reply_passed_back_as_it_came(server):
    """An assistant message as OpenAI's API returns it (null refusal / audio / function_call / tool_calls,
    empty annotations) is taken back; citations it carried are refused by name, never dropped."""
    reply = {"role": "assistant", "content": "Hello.", "refusal": None, "annotations": [], "audio": None,
             "function_call": None, "tool_calls": None}
    body = {"model": "tiny", "messages": [*QUESTION, reply, {"role": "user", "content": "Again."}], "max_tokens": 2}
    assert server.http.post("/v1/chat/completions", json=body).status_code == 200
    cited = {**reply, "annotations": [{"type": "url_citation", "url_citation": {"url": "https://example.com"}}]}
    answer = server.http.post("/v1/chat/completions", json={**body, "messages": [*QUESTION, cited]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages[1].annotations"
