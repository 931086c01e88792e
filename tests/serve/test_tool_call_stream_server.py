"""Streamed tool calls through a real server (the tiny random chat model, greedy) and the `openai`
SDK: the deltas a client accumulates equal the whole response's `tool_calls`, and the name comes in
an earlier chunk than the last arguments fragment (the call streams, it is not sent at the end)."""

from __future__ import annotations

import json

import pytest

from serve_helpers import CHATML, serve, tiny_chat_generator

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 9}},
             "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "search", "parameters": {
             "type": "object", "properties": {"q": {"enum": ["rain", "sun {\"x\"}"]}}, "required": ["q"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# a template that knows tools, in few tokens (the generic format's prompt outgrows the tiny model's context)
TOOLS_CHATML = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                "<|im_end|>\n{% endif %}" + CHATML)


@pytest.fixture(scope="module")
def server():
    with serve(tiny_chat_generator(chat_template=TOOLS_CHATML)) as running:
        yield running


def ask(client, **request):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=0,
                                          max_tokens=120, **request)


def streamed(client, **request) -> tuple[str, dict[int, dict], dict[int, dict], dict[int, list[str]], str]:
    """-> (content, calls by index, per call the chunk numbers of its name and arguments, per call
    its arguments fragments, finish reason)."""
    content, calls, chunks, fragments, reason = "", {}, {}, {}, None
    for number, chunk in enumerate(ask(client, stream=True, **request)):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for part in choice.delta.tool_calls or []:
            if part.id is not None:
                assert part.index == len(calls) and part.function.arguments == "" and part.type == "function"
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                chunks[part.index], fragments[part.index] = {"name": number, "arguments": []}, []
            else:
                calls[part.index]["arguments"] += part.function.arguments
                chunks[part.index]["arguments"].append(number)
                fragments[part.index].append(part.function.arguments)
    return content, calls, chunks, fragments, reason


def token_fragments(tokens: list[str], arguments: str) -> list[str]:
    """``arguments`` cut where the generated tokens were cut: one fragment per token that adds to it."""
    text = "".join(tokens)
    start, ends, at = text.index(arguments), [], 0
    for token in tokens:
        at += len(token)
        ends.append(at)
    cuts = [start] + [end for end in ends if start < end < start + len(arguments)] + [start + len(arguments)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_streamed_calls_equal_the_whole_response(server, choice):
    client = server.client()
    whole = ask(client, tool_choice=choice, parallel_tool_calls=False, logprobs=True).choices[0]
    assert whole.finish_reason == "tool_calls" and len(whole.message.tool_calls) == 1
    content, calls, chunks, fragments, reason = streamed(client, tool_choice=choice, parallel_tool_calls=False)
    assert reason == "tool_calls" and not content and whole.message.content is None
    expected = whole.message.tool_calls[0].function
    assert (calls[0]["name"], calls[0]["arguments"]) == (expected.name, expected.arguments)
    json.loads(calls[0]["arguments"])
    assert chunks[0]["name"] < chunks[0]["arguments"][-1]
    # the arguments came as they were generated: one fragment per token, not cut up at the end
    assert fragments[0] == token_fragments([t.token for t in whole.logprobs.content], expected.arguments)
    assert len(fragments[0]) > 3


def test_auto_without_a_call_streams_the_same_content(server):
    client = server.client()
    whole = ask(client, max_completion_tokens=24).choices[0]
    content, calls, _, _, reason = streamed(client, max_completion_tokens=24)
    assert not calls and content == whole.message.content and reason == whole.finish_reason
