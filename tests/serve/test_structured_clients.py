"""The client libraries people put in front of a local server, against a real `fastdecode serve`
(the embedded SmolLM2-135M-Instruct) on loopback: structured outputs and tool calls come back
valid for openai, langchain-openai and instructor. Greedy (temperature 0) throughout, so that
each answer is the same every run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import free_port

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int = pydantic.Field(ge=0, le=120)


@pytest.fixture(scope="module")
def base_url():
    from fastdecode.api import default_model_path
    from fastdecode.errors import ModelNotFoundError

    try:
        default_model_path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "fastdecode.cli", "serve", "--port", str(port),
                                "--model-name", "smol"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def ask(client, **request):
    """A greedy chat completion from the served model."""
    return client.chat.completions.create(model="smol", temperature=0, **request)


def at_once(*calls):
    """Each call's result, the calls sent together: the server batches them (and a batched answer
    equals the answer alone, tests/engine), so the suite waits for the longest, not for the sum."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def check_call(call, tool: dict) -> dict:
    assert call.type == "function" and call.id and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


def test_openai_parse_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "blue"]},
                                                          "maxItems": 3}}, "required": ["colors"]}
    parsed, colors, answer = at_once(
        lambda: client.chat.completions.parse(model="smol", temperature=0, response_format=Person, max_tokens=60,
                                              messages=[{"role": "user", "content": "Invent a person."}]),
        lambda: ask(client, messages=[{"role": "user", "content": "Name colors."}], max_tokens=60,
                    response_format={"type": "json_schema", "json_schema": {"name": "colors", "schema": schema,
                                                                            "strict": True}}),
        lambda: ask(client, messages=[{"role": "user", "content": "A JSON object."}],
                    max_tokens=60, response_format={"type": "json_object"}))
    assert isinstance(parsed.choices[0].message.parsed, Person)
    jsonschema.validate(json.loads(colors.choices[0].message.content), schema)
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_openai_tools_required_named_auto_and_a_round_trip(client):
    required, named, auto, forced = at_once(
        lambda: ask(client, messages=QUESTION, tools=[WEATHER, TIME], tool_choice="required",
                    parallel_tool_calls=False, max_tokens=60),
        lambda: ask(client, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=60,
                    tool_choice={"type": "function", "function": {"name": "get_time"}}),
        lambda: ask(client, messages=QUESTION, tools=[WEATHER], max_tokens=60),
        lambda: ask(client, messages=QUESTION, tools=[WEATHER], max_tokens=60,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call, WEATHER if call.function.name == "get_weather" else TIME)
    check_call(named.choices[0].message.tool_calls[0], TIME)
    message = auto.choices[0].message
    for call in message.tool_calls or []:
        check_call(call, WEATHER)
    assert message.tool_calls or isinstance(message.content, str)
    assistant = forced.choices[0].message
    history = QUESTION + [assistant.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": assistant.tool_calls[0].id,
                           "content": [{"type": "text", "text": "22 C and sunny"}]}]
    final = ask(client, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=30)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None


def test_openai_streams_tool_call_deltas(client):
    stream = ask(client, messages=QUESTION, tools=[WEATHER], max_tokens=60,
                 tool_choice={"type": "function", "function": {"name": "get_weather"}},
                 stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": part.function.name, "arguments": ""})
            entry["arguments"] += part.function.arguments or ""
    assert reasons[-1] == "tool_calls" and list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_bad_structured_requests_are_openai_errors_naming_the_field(client):
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
              "response_format", "Invalid type"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice", "nope"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                      "if": {}}}}]},
              "tools[0].function.parameters", "if"),
             ({"structured_outputs": {"regex": "("}}, "structured_outputs", "unclosed"),
             ({"grammar": "root ::= missing"}, "grammar", "missing")]
    for extra, param, text in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(client, messages=QUESTION, max_tokens=5, extra_body=extra)
        error = caught.value.body
        assert error["param"] == param and text in error["message"], error


def test_vllm_and_llama_cpp_forms(client):
    forms = (({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
             ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: len(t) == 4 and t.isdigit()),
             ({"grammar": 'root ::= "A" | "B"'}, lambda t: t in ("A", "B")),
             ({"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                               "required": ["ok"]}}, lambda t: isinstance(json.loads(t)["ok"], bool)))
    answers = at_once(*(lambda extra=extra: ask(client, messages=QUESTION, max_tokens=20, extra_body=extra)
                        for extra, _ in forms))
    for (extra, check), answer in zip(forms, answers):
        assert check(answer.choices[0].message.content), (extra, answer.choices[0].message.content)


def test_langchain_structured_output_and_bind_tools(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    model = langchain_openai.ChatOpenAI(base_url=base_url, api_key="unused", model="smol", max_tokens=60,
                                        temperature=0, max_retries=0)
    weather = {"title": "get_weather", "description": "The current weather in a city",
               **WEATHER["function"]["parameters"]}
    *people, message = at_once(
        *(lambda method=method: model.with_structured_output(Person, method=method).invoke("Invent a person.")
          for method in ("json_schema", "function_calling")),
        lambda: model.bind_tools([weather], tool_choice="get_weather").invoke("What is the weather in Paris?"))
    for person, method in zip(people, ("json_schema", "function_calling")):
        assert isinstance(person, Person), method
    assert message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER["function"]["parameters"])


def test_instructor_tools_and_json_schema_modes(base_url):
    instructor = pytest.importorskip("instructor")
    modes = (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA)

    def person(mode):
        client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode)
        return client.chat.completions.create(model="smol", temperature=0, response_model=Person, max_tokens=80,
                                              max_retries=0, messages=[{"role": "user", "content": "Invent a person."}])

    for answer, mode in zip(at_once(*(lambda mode=mode: person(mode) for mode in modes)), modes):
        assert isinstance(answer, Person), mode
