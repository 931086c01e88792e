"""POST /v1/messages through the `anthropic` SDK on a real server: the same text as
/v1/chat/completions (and offline generate) with the same options, plain and streamed, its stop
reasons and usage, x-api-key as the key, and the unsupported parts refused by name."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, serve, server, tiny_chat_generator  # noqa: F401 (fixtures)

anthropic = pytest.importorskip("anthropic")
SYSTEM = "You are terse."
QUESTION = "What is the capital of France?"
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more: sent as extra fields
CONVERSATION = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


def client(running, key: str = "unused"):
    return anthropic.Anthropic(base_url=running.base, api_key=key, max_retries=0, timeout=60)


def test_messages_create_plain_and_streamed(server, chat_generator):
    expected = chat_generator.generate(CONVERSATION, max_new_tokens=8)
    answer = client(server).messages.create(model="tiny", max_tokens=8, system=SYSTEM, extra_body=GREEDY,
                                            messages=[{"role": "user", "content": QUESTION}])
    assert answer.content[0].type == "text" and answer.content[0].text == expected
    assert answer.stop_reason == "max_tokens" and answer.role == "assistant"
    assert answer.usage.input_tokens == len(chat_generator.encode_prompt(CONVERSATION))
    assert answer.usage.output_tokens == 8
    blocks = [{"type": "text", "text": QUESTION}]
    with client(server).messages.stream(model="tiny", max_tokens=8, extra_body=GREEDY,
                                        system=[{"type": "text", "text": SYSTEM}],
                                        messages=[{"role": "user", "content": blocks}]) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == expected == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_stop_sequences_and_sampling_options(server, chat_generator):
    full = chat_generator.generate(CONVERSATION[1:], max_new_tokens=12)
    stop = full[3:6]
    answer = client(server).messages.create(model="tiny", max_tokens=12, stop_sequences=[stop], extra_body=GREEDY,
                                            messages=[{"role": "user", "content": QUESTION}])
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == stop
    assert answer.content[0].text == chat_generator.generate(CONVERSATION[1:], max_new_tokens=12, stop=[stop])
    sampled = chat_generator.generate(CONVERSATION[1:], max_new_tokens=6, do_sample=True, temperature=0.7,
                                      top_k=5, top_p=0.9, seed=3)
    answer = client(server).messages.create(model="tiny", max_tokens=6, messages=[{"role": "user", "content": QUESTION}],
                                            extra_body={"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3})
    assert answer.content[0].text == sampled


def test_unsupported_parts_are_refused_by_name(server):
    messages = [{"role": "user", "content": QUESTION}]
    tools = [{"type": "web_search_20250305", "name": "web_search"}]
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        client(server).messages.create(model="tiny", max_tokens=4, messages=messages, tools=tools)
    image = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client(server).messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": image}])
    with pytest.raises(anthropic.BadRequestError, match="prefill"):
        client(server).messages.create(model="tiny", max_tokens=4,
                                       messages=messages + [{"role": "assistant", "content": "Par"}])
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        client(server).messages.create(model="tiny", max_tokens=4, messages=messages, extra_body={"temperature": 1.5})
    error = server.http.post("/v1/messages", json={"model": "tiny", "messages": messages}).json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]


def test_a_message_or_block_key_it_does_not_take_is_named_not_dropped(server, chat_generator):
    text = {"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}  # cache_control: accepted
    for messages, key in [([{"role": "user", "content": QUESTION, "name": "Ada"}], "messages[0].name"),
                          ([{"role": "user", "content": [{**text, "colour": "red"}]}], "messages[0].content[0].colour")]:
        body = {"model": "tiny", "max_tokens": 2, "messages": messages}
        answer = server.http.post("/v1/messages", json=body)
        assert answer.status_code == 400 and key in answer.json()["error"]["message"], answer.text
        with serve(chat_generator, lenient=True) as running:
            assert running.http.post("/v1/messages", json=body).status_code == 200
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [text]}]}
    assert server.http.post("/v1/messages", json=body).status_code == 200


@pytest.mark.parametrize("fields, named", [
    ({"model": 5}, "model must be a string"),  # was answered as the served model
    ({"max_tokens": 0}, "max_tokens (an integer >= 1)"),  # was refused as "only allowed with echo"
    ({"stop_sequences": "Paris"}, "stop_sequences must be a list"),  # a string was taken as one stop
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences must be a list of at most 4"),  # named "stop"
])
def test_bad_fields_are_named_as_the_messages_api_names_them(server, fields, named):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": QUESTION}], **fields}
    answer = server.http.post("/v1/messages", json=body)
    assert answer.status_code == 400 and named in answer.json()["error"]["message"], answer.text


def test_x_api_key_is_accepted(chat_generator):
    with serve(chat_generator, api_key="sekret") as running:
        messages = [{"role": "user", "content": QUESTION}]
        with pytest.raises(anthropic.AuthenticationError):
            client(running, "wrong").messages.create(model="tiny", max_tokens=2, messages=messages)
        assert client(running, "sekret").messages.create(model="tiny", max_tokens=2, messages=messages).content


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                            "additionalProperties": False}}


def test_tool_use_round_trip():
    with serve(tiny_chat_generator(max_positions=1024)) as running:  # the tools' description lengthens the prompt
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        answer = client(running).messages.create(model="tiny", max_tokens=150, messages=messages, tools=[WEATHER],
                                                 tool_choice={"type": "any"}, extra_body=GREEDY)
        uses = [block for block in answer.content if block.type == "tool_use"]
        assert answer.stop_reason == "tool_use" and uses[0].name == "get_weather"
        assert uses[0].input["city"] in ("Paris", "Rome")
        with client(running).messages.stream(model="tiny", max_tokens=150, messages=messages, tools=[WEATHER],
                                             tool_choice={"type": "tool", "name": "get_weather"},
                                             extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert final.stop_reason == "tool_use" and final.content[-1].input["city"] in ("Paris", "Rome")
        follow = messages + [{"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id,
                                                                "name": "get_weather", "input": uses[0].input}]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                           "content": "sunny"}]}]
        reply = client(running).messages.create(model="tiny", max_tokens=5, messages=follow, tools=[WEATHER],
                                                tool_choice={"type": "none"}, extra_body=GREEDY)
        assert reply.content[0].type == "text" and reply.stop_reason == "max_tokens"
