"""The incremental tool-call parser (serve/tool_calls.py) fed as a stream: token by token, split at
every character boundary. A call is announced (index, id, type, name, arguments "") as soon as
its name is complete, its arguments follow in fragments that join to valid JSON, text that is
not a call reaches the client as content."""

from __future__ import annotations

import json

import pytest

from fastdecode.serve.tool_calls import ToolCallParser, parse_tool_calls

NAMES = ["get_weather", "search"]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
TRICKY_ARGUMENTS = r'{"q": "a } { \" ] <tool_call> \\", "n": [1, {"x": "}"}], "e": {}}'


def run(pieces: list[str], names: list[str] = NAMES) -> tuple[list[list[dict]], ToolCallParser]:
    """-> (the deltas answered per piece, the last entry those of finish(); the parser)."""
    parser = ToolCallParser(names)
    return [parser.feed(piece) for piece in pieces] + [parser.finish()], parser


def accumulate(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What an OpenAI client builds from the deltas: the content, the calls by index."""
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for part in delta.get("tool_calls", []):
            if "id" in part:
                assert part["index"] == len(calls) and part["type"] == "function"
                assert part["function"]["arguments"] == ""  # the header comes alone
                calls.append({"id": part["id"], "name": part["function"]["name"], "arguments": ""})
            else:
                assert "name" not in part["function"]
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls


def flat(per_piece: list[list[dict]]) -> list[dict]:
    return [delta for deltas in per_piece for delta in deltas]


def test_a_call_fed_character_by_character():
    text = "Sure, let me look. " + CALL
    per_piece, parser = run(list(text))
    content, calls = accumulate(flat(per_piece))
    assert content == "Sure, let me look. "
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert parser.finish_reason("stop") == "tool_calls"
    # the name is sent the moment its closing quote arrives, the arguments one fragment per character
    name_end = text.index('"get_weather"') + len('"get_weather"')
    assert per_piece[name_end - 1] == [{"tool_calls": [{"index": 0, "id": calls[0]["id"], "type": "function",
                                                        "function": {"name": "get_weather", "arguments": ""}}]}]
    fragments = [d for d in flat(per_piece) if "tool_calls" in d and "id" not in d["tool_calls"][0]]
    assert len(fragments) == len('{"city": "Paris", "days": 2}')
    # content is not held back longer than it must be: "Sure" is out before the call begins
    assert accumulate(flat(per_piece[:4]))[0] == "Sure"


@pytest.mark.parametrize("text", ["Sure. " + CALL, CALL + "\n" + CALL.replace("Paris", "Rome")])
def test_every_split_gives_the_same_deltas_as_the_whole_text(text):
    whole_content, whole_calls = accumulate(flat(run([text])[0]))
    for split in range(len(text) + 1):
        content, calls = accumulate(flat(run([text[:split], text[split:]])[0]))
        assert content == whole_content, split
        assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in whole_calls]
    content, calls = parse_tool_calls(text, NAMES)
    assert [c["function"]["arguments"] for c in calls] == [c["arguments"] for c in whole_calls]


def test_arguments_with_braces_and_escaped_quotes_inside_strings():
    text = '<tool_call>{"name": "search", "arguments": ' + TRICKY_ARGUMENTS + '}</tool_call>'
    per_piece, parser = run(list(text))
    content, calls = accumulate(flat(per_piece))
    assert content == "" and len(calls) == 1
    assert calls[0]["arguments"] == TRICKY_ARGUMENTS
    assert json.loads(calls[0]["arguments"])["q"] == 'a } { " ] <tool_call> \\'
    assert parser.valid_calls()[0]["function"]["arguments"] == TRICKY_ARGUMENTS


def test_two_parallel_calls_get_indexes_0_and_1_and_no_blank_content():
    second = '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    per_piece, parser = run(list(CALL + "\n" + second + "\n"))
    content, calls = accumulate(flat(per_piece))
    assert content == "" and [c["name"] for c in calls] == ["get_weather", "search"]
    assert calls[1]["arguments"] == '{"q": "rain"}' and calls[0]["id"] != calls[1]["id"]
    assert len(parser.valid_calls()) == 2


@pytest.mark.parametrize("text", [
    "a <tool_c> tag and a < b",  # a prefix of the tag, then something else
    "<tool_call>not json</tool_call>",
    '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not an offered function
    '<tool_call>{"city": "Paris"}</tool_call> end',  # an object without a name
    '<tool_call>{"name": "get_wea',  # cut off before the name was complete
    "<tool_call>",
])
def test_false_starts_reach_the_client_as_content(text):
    for pieces in (list(text), [text]):
        per_piece, parser = run(pieces)
        assert accumulate(flat(per_piece)) == (text, [])
        assert parser.finish_reason("stop") == "stop"
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_false_start_followed_by_a_real_call():
    text = "<tool_<tool_call>oops <tool_call>{" + CALL[len("<tool_call>{"):]
    content, calls = accumulate(flat(run(list(text))[0]))
    assert content == "<tool_<tool_call>oops " and [c["name"] for c in calls] == ["get_weather"]


def test_other_spellings_arguments_first_as_a_string_or_no_closing_tag():
    first = '<tool_call>{"arguments": {"q": "x"}, "name": "search"}</tool_call>'
    assert accumulate(flat(run(list(first))[0]))[1][0]["arguments"] == '{"q": "x"}'
    as_string = '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    assert accumulate(flat(run(list(as_string))[0]))[1][0]["arguments"] == '{"q": "x"}'
    unclosed = '<tool_call>{"name": "search", "parameters": {"q": "x"}}'
    per_piece, parser = run(list(unclosed))
    assert accumulate(flat(per_piece))[1][0]["arguments"] == '{"q": "x"}' and len(parser.valid_calls()) == 1
    no_arguments = '<tool_call>{"name": "search"}</tool_call>'
    assert accumulate(flat(run([no_arguments])[0]))[1][0]["arguments"] == "{}"


def test_a_call_cut_off_stays_sent_and_the_reason_is_the_engines():
    per_piece, parser = run(list('<tool_call>{"name": "search", "arguments": {"q": "ra'))
    content, calls = accumulate(flat(per_piece))
    assert content == "" and calls[0]["arguments"] == '{"q": "ra'  # as OpenAI streams a truncated call
    assert parser.finish_reason("length") == "length" and parser.valid_calls() == []
