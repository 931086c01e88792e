"""Tool calls streamed as they are generated on /v1/responses and /v1/messages: the item reader
(serve/output_items.py) on scripted text cut every way, then the real `openai` and `anthropic`
SDKs in their streaming modes against one server (the tiny random chat model, greedy, a forced
call): the call's item / block opens with its name before the last fragment of its arguments,
the arguments come in several fragments, and what the SDK accumulates equals the whole
(non-streamed) response."""

from __future__ import annotations

import json

import pytest
from serve_helpers import serve, tiny_chat_generator

from fastdecode.serve.output_items import OutputItems

NAMES = ["get_weather", "search"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'


def read(text: str, cuts: int | None = None) -> list[tuple]:
    """``text`` fed in pieces of ``cuts`` characters (whole when None) -> the events, merged per item."""
    items = OutputItems(NAMES)
    pieces = [text] if cuts is None else [text[i:i + cuts] for i in range(0, len(text), cuts)]
    events = [e for piece in pieces for e in items.feed(piece)] + items.finish()
    merged: list[list] = []
    for e in events:
        if e.kind in ("text_start", "call_start"):
            merged.append([e.kind, e.position, e.name, ""])
        elif e.kind in ("text", "arguments"):
            assert merged[-1][1] == e.position
            merged[-1][3] += e.text
        else:
            assert merged[-1][1] == e.position and merged[-1][3] == e.text  # the end repeats the whole
            merged[-1][0] += "/" + e.kind
    return [tuple(m) for m in merged], items


@pytest.mark.parametrize("cuts", [None, 1, 3, 7])
def test_text_then_calls_then_text_any_split(cuts):
    text = "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\nDone."
    events, items = read(text, cuts)
    assert events == [("text_start/text_end", 0, "", "Let me look.\n"),
                      ("call_start/call_end", 1, "get_weather", '{"city": "Paris", "days": 2}'),
                      ("call_start/call_end", 2, "get_weather", '{"city": "Rome", "days": 2}'),
                      ("text_start/text_end", 3, "", "\nDone.")]
    assert items.called and [i.call_id for i in items.items if i.is_call][0].startswith("call_")


def test_blank_text_around_calls_opens_no_item():
    events, items = read("\n  " + CALL + "\n\n")
    assert events == [("call_start/call_end", 0, "get_weather", '{"city": "Paris", "days": 2}')]


def test_arguments_grow_before_the_call_ends():
    items = OutputItems(NAMES)
    first = items.feed('<tool_call>{"name": "get_weather", "arguments": {"ci')
    assert [e.kind for e in first] == ["call_start", "arguments"] and first[1].text == '{"ci'
    assert [e.kind for e in items.feed('ty": "Paris"}}')] == ["arguments"]
    assert [e.kind for e in items.feed("</tool_call>")] == ["call_end"]  # closed when its end is read
    assert items.finish() == []


def test_no_call_and_false_starts_are_text():
    assert read("<tool_call>not json, <b>bold</b>")[0] == [("text_start/text_end", 0, "",
                                                             "<tool_call>not json, <b>bold</b>")]
    assert read('<tool_call>{"name": "unknown"}</tool_call>')[0][0][3].startswith("<tool_call>")
    events, items = read("")
    assert events == [("text_start/text_end", 0, "", "")] and not items.called  # an empty reply: one empty text


def test_a_call_cut_off_is_not_a_tool_call_reason():
    events, items = read('<tool_call>{"name": "search", "arguments": {"q": "ra')
    assert events == [("call_start/call_end", 0, "search", '{"q": "ra')] and not items.called


# -- through the SDKs ---------------------------------------------------------------------------------
OPENAI_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                               "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}},
                              "required": ["city", "days"], "additionalProperties": False}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "The weather in a city",
                  "input_schema": OPENAI_TOOL["parameters"]}
QUESTION = "Weather in Paris?"


@pytest.fixture(scope="module")
def running():
    pytest.importorskip("fastapi")
    pytest.importorskip("llguidance")
    with serve(tiny_chat_generator(max_positions=1024)) as server:  # the tools' description lengthens the prompt
        yield server


def test_responses_stream_function_call_items(running):
    openai = pytest.importorskip("openai")
    client = running.client()
    request = dict(model="tiny", input=QUESTION, tools=[OPENAI_TOOL], tool_choice="required", max_output_tokens=150,
                   temperature=0, parallel_tool_calls=False)
    whole = client.responses.create(**request)
    expected = [(item.type, getattr(item, "name", None), getattr(item, "arguments", None)) for item in whole.output]
    assert ("function_call", "get_weather") == expected[-1][:2]
    events = list(client.responses.create(stream=True, **request))
    kinds = [e.type for e in events]
    added = [i for i, e in enumerate(events) if e.type == "response.output_item.added" and e.item.type == "function_call"]
    fragments = [i for i, e in enumerate(events) if e.type == "response.function_call_arguments.delta"]
    assert len(added) == 1 and len(fragments) > 1 and added[0] < fragments[-1]  # streamed, not sent at the end
    call_id = events[added[0]].item.id
    assert all(events[i].item_id == call_id for i in fragments)
    done = events[kinds.index("response.function_call_arguments.done")]
    assert done.arguments == "".join(events[i].delta for i in fragments) == expected[-1][2]
    assert kinds[-1] == "response.completed"
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None))
            for o in events[-1].response.output] == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the SDK's accumulating stream helper builds the same items from the events
    with client.responses.stream(**request) as stream:
        final = stream.get_final_response()
    assert isinstance(final, openai.types.responses.Response)
    assert [(o.type, getattr(o, "arguments", None)) for o in final.output] == [(t, a) for t, _, a in expected]


def test_messages_stream_tool_use_blocks(running):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=running.base, api_key="unused", max_retries=0, timeout=60)
    request = dict(model="tiny", max_tokens=150, messages=[{"role": "user", "content": QUESTION}],
                   tools=[ANTHROPIC_TOOL], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                   extra_body={"temperature": 0})
    whole = client.messages.create(**request)
    uses = [block for block in whole.content if block.type == "tool_use"]
    assert whole.stop_reason == "tool_use" and len(uses) == 1
    events = list(client.messages.create(stream=True, **request))
    starts = [i for i, e in enumerate(events) if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    fragments = [i for i, e in enumerate(events) if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(starts) == 1 and len(fragments) > 1 and starts[0] < fragments[-1]  # streamed, not sent at the end
    block = events[starts[0]].content_block
    assert block.name == "get_weather" and block.input == {} and block.id.startswith("toolu_")
    index = events[starts[0]].index
    assert all(events[i].index == index for i in fragments)
    assert json.loads("".join(events[i].delta.partial_json for i in fragments)) == uses[0].input
    stop = next(i for i, e in enumerate(events) if e.type == "content_block_stop" and e.index == index)
    assert fragments[-1] < stop
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"
    # the SDK's accumulating stream helper: its input_json events and the final message
    with client.messages.stream(**request) as stream:
        snapshots = [e.snapshot for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert len(snapshots) > 1 and snapshots[-1] == uses[0].input
    assert final.stop_reason == "tool_use" and [(b.type, getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "input", None)) for b in whole.content]
