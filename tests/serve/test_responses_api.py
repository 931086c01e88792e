"""POST /v1/responses (stateless core, text only) through the `openai` SDK's responses.create on a
real server: the same text as offline generate, plain and streamed with the typed events, and the
unsupported parts refused by name."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, server  # noqa: F401 (fixtures)

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
             (dict(store=True), "store"), (dict(tools=[{"type": "web_search"}]), "tools"),
             (dict(reasoning={"effort": "high"}), "reasoning"), (dict(unknown_thing=1), "unknown_thing")]
    for fields, param in cases:
        extra = {"extra_body": {"unknown_thing": 1}} if param == "unknown_thing" else fields
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="tiny", input=QUESTION, max_output_tokens=4, **extra)
        assert caught.value.body["param"] == param, fields
    item = [{"type": "function_call_output", "call_id": "c1", "output": "42"}]
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
