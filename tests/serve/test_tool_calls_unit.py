"""Tool calling's pieces without a model: request validation, the prompt (native template and the
generic format), the forced-call grammar, parsing the Hermes format, streamed deltas."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from fastdecode.loading.tokenizer.chat_template import compile_chat_template, render_chat_template  # noqa: E402
from fastdecode.serve.protocol import APIError  # noqa: E402
from fastdecode.serve.tool_calls import ToolStream, parse_tool_calls, tool_call_deltas  # noqa: E402
from fastdecode.serve.tools import GENERIC_TOOL_PROMPT, parse_tools, render_messages, tool_grammar  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NATIVE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}"
          "<|im_end|>\n{% endfor %}")
PLAIN = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "content": "22 C", "tool_call_id": "call_1"}]


def render(template: str, messages: list, request) -> str:
    messages, extra = render_messages(messages, request, template)
    return render_chat_template(compile_chat_template(template), messages, False, {}, extra)


def test_native_templates_get_the_tools_and_the_history_as_they_are():
    text = render(NATIVE, HISTORY, parse_tools({"tools": [WEATHER]}))
    assert '"name": "get_weather"' in text.split("<|im_end|>")[0]  # the tools, from the template itself
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n22 C" in text


def test_templates_without_tools_get_the_generic_format():
    text = render(PLAIN, HISTORY, parse_tools({"tools": [WEATHER]}))
    assert GENERIC_TOOL_PROMPT.split("{tools}")[0] in text and '"name": "get_weather"' in text
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    assert "<|im_start|>assistant\n" + call in text
    assert "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>" in text
    assert "You can call functions" not in render(PLAIN, HISTORY, parse_tools({"tools": [WEATHER],
                                                                             "tool_choice": "none"}))


def test_forced_calls_are_a_grammar_and_auto_is_not():
    assert tool_grammar(parse_tools({"tools": [WEATHER]})) is None
    named = tool_grammar(parse_tools({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                                          "function": {"name": "get_weather"}}}))
    assert named["grammar"].startswith("start: call\n") and '"const": "get_weather"' in named["grammar"]
    assert '"additionalProperties": false' in named["grammar"]  # only the named arguments
    several = tool_grammar(parse_tools({"tools": [WEATHER], "tool_choice": "required"}))
    assert several["grammar"].startswith('start: call ("\\n" call)*')


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_fields_name_the_field(body, param):
    with pytest.raises(APIError) as caught:
        parse_tools(body)
    assert caught.value.param == param


def test_parsing_the_hermes_format():
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n' \
           '<tool_call>{"name": "unknown", "arguments": {}}</tool_call><tool_call>not json</tool_call>'
    content, calls, first = parse_tool_calls(text, ["get_weather"])
    assert content == "Let me check." and len(calls) == 1 and text[first:].startswith("<tool_call>")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    assert parse_tool_calls("plain answer", ["get_weather"]) == ("plain answer", [], 12)


def test_streams_hold_back_a_call_and_send_openai_deltas():
    stream = ToolStream(["get_weather"])
    full = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    sent = [stream.content(full[:n]) for n in (4, 7, 9, 30)]
    assert "".join(sent) == "Sure " and sent[1] == " "  # "<t" might start a call: held
    rest, calls = stream.finish(full)
    assert rest == "" and len(calls) == 1
    deltas = tool_call_deltas(calls)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert all(d["tool_calls"][0]["index"] == 0 for d in deltas)
    plain = ToolStream(["get_weather"])
    assert plain.content("a < b") == "a < b" and plain.finish("a < b and more") == (" and more", [])
