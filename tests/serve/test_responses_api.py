"""POST /v1/responses (stateless core, text only) through the `openai` SDK's responses.create on a
real server: the same text as offline generate, plain and streamed with the typed events, and the
unsupported parts refused by name."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, serve, server, tiny_chat_generator  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
QUESTION = "What is the capital of France?"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]


def test_responses_create_plain(server, chat_generator):
    client = server.client()
    expected = chat_generator.generate(CONVERSATION, max_new_tokens=8)
    response = client.responses.create(model="tiny", input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)
    assert response.output_text == expected
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.input_tokens == len(chat_generator.encode_prompt(CONVERSATION))
    assert response.usage.output_tokens == 8
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    assert client.responses.create(model="tiny", input=items, max_output_tokens=8, temperature=0).output_text == expected
    sampled = chat_generator.generate(CONVERSATION[1:], max_new_tokens=6, do_sample=True, top_p=0.9, seed=4)
    assert client.responses.create(model="tiny", input=QUESTION, max_output_tokens=6, top_p=0.9,
                                   extra_body={"seed": 4}).output_text == sampled


def test_responses_create_streamed(server, chat_generator):
    expected = chat_generator.generate(CONVERSATION, max_new_tokens=8)
    events = list(server.client().responses.create(model="tiny", input=QUESTION, instructions="Be brief.",
                                                   max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected
    assert events[-1].response.output_text == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_unsupported_parts_are_refused_by_name(server):
    client = server.client()
    cases = [(dict(text={"format": {"type": "xml"}}), "text.format"),
             (dict(previous_response_id="resp_1"), "previous_response_id"),
             (dict(store=True), "store"), (dict(conversation="conv_1"), "conversation"),
             (dict(reasoning={"effort": "high"}), "reasoning"), (dict(unknown_thing=1), "unknown_thing")]
    for fields, param in cases:
        extra = {"extra_body": {"unknown_thing": 1}} if param == "unknown_thing" else fields
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, **extra)
        assert caught.value.body["param"] == param, fields
    # named as the client sent them: max_output_tokens (was "max_completion_tokens", the chat field it maps to),
    # text's unknown key (every one was reported as "text.verbosity")
    for fields, param, named in [(dict(max_output_tokens=0), "max_output_tokens", "max_output_tokens must be"),
                                 (dict(text={"format": {"type": "text"}, "colour": "red"}), "text", "text.colour")]:
        answer = server.http.post("/v1/responses", json={"model": "tiny", "input": QUESTION, "max_output_tokens": 4,
                                                         **fields})
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == param and named in error["message"], answer.text
    item = [{"type": "item_reference", "id": "msg_1"}]  # a stored item: nothing is stored
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input=item, max_output_tokens=4)
    assert caught.value.body["param"] == "input[0]"


def test_responses_with_a_json_schema_text_format(server):
    import json

    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Berlin"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    response = server.client().responses.create(model="tiny", input=QUESTION, max_output_tokens=40, temperature=0,
                                                text={"format": fmt})
    assert json.loads(response.output_text)["city"] in ("Paris", "Rome", "Berlin")
    assert response.text.format.type == "json_schema"


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}


def test_responses_function_tools_round_trip():
    with serve(tiny_chat_generator(max_positions=1024)) as running:  # the tools' description lengthens the prompt
        tools_round_trip(running.client())


def tools_round_trip(client):
    import json

    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", max_output_tokens=150, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER],
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=150, temperature=0, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].type == "function_call"
    # the call and its result go back in as input items
    follow = [{"role": "user", "content": "Weather in Paris?"},
              {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
    answer = client.responses.create(model="tiny", input=follow, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=5, temperature=0)
    assert answer.output[0].type == "message"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}], max_output_tokens=4)
    assert caught.value.body["param"] == "tools[0]"
