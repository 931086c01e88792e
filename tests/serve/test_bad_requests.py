"""Bad requests get their status and an OpenAI error object; the server keeps answering."""

from __future__ import annotations

import time

import pytest

from serve_helpers import chat_generator, serve, server  # noqa: F401 (fixtures)

QUESTION = [{"role": "user", "content": "Hi"}]


def post(server, path: str, body=None, content=None, headers=None, expect: int = 400) -> dict:
    response = server.http.post("/v1" + path, json=body, content=content, headers=headers)
    assert response.status_code == expect, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert server.http.get("/health").json()["status"] == "ok"
    return error


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": QUESTION, "max_tokens": 4, **fields}


@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens="ten"), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_completion_tokens=True), "max_completion_tokens"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(n=0), "n"),
    (dict(n=100), "n"),
    (dict(stream="yes"), "stream"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(seed=1.5), "seed"),
    (dict(top_logprobs=3), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=50), "top_logprobs"),
    (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(min_tokens=9), "min_tokens"),
    (dict(num_beams=2, n=3), "n"),
    (dict(num_beams=2, logprobs=True), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(messages=[]), "messages"),
    (dict(messages="Hi"), "messages"),
    (dict(messages=[{"role": "robot", "content": "beep"}]), "messages[0].role"),
    (dict(messages=[{"role": "user", "content": 7}]), "messages[0].content"),
    # a message's keys: OpenAI's that cannot be taken back, one role's on another, unknown ones
    (dict(messages=[{"role": "assistant", "content": "x", "refusal": "No."}, *QUESTION]), "messages[0].refusal"),
    (dict(messages=[{"role": "user", "content": "Hi", "tool_call_id": "c1"}]), "messages[0].tool_call_id"),
    (dict(messages=[{"role": "user", "content": "Hi", "name": 5}]), "messages[0].name"),
    (dict(messages=[{"role": "user", "content": "Hi", "nmae": "bob"}]), "messages[0].nmae"),
    # a tool's keys (they were silently dropped)
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "colour": 1}}]),
     "tools[0].function.colour"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}, "colour": 1}]), "tools[0].colour"),
    # stream_options: only with stream, include_usage a bool (the string "false" was taken as true)
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(stream=True, stream_options={"include_usage": "false"}), "stream_options.include_usage"),
    (dict(stream=True, stream_options={"continuous_usage_stats": True}), "stream_options.continuous_usage_stats"),
    (dict(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
    # checks that came from the engine without naming their field (or naming a seed the client never sent)
    (dict(seed=2**64), "seed"),
    (dict(seed=2**64 - 1, n=2, temperature=1.0), "seed"),
    (dict(num_beams=2, stop=["x"]), "stop"),
])
def test_bad_chat_fields(server, fields, param):
    error = post(server, "/chat/completions", chat(**fields))
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_bad_bodies_and_routes(server):
    assert post(server, "/chat/completions", content=b"{not json")["code"] == "invalid_json"
    assert post(server, "/chat/completions", content=b"[1, 2]")["code"] == "invalid_json"
    assert post(server, "/chat/completions", content=b"\xff\xfe")["code"] == "invalid_json"
    assert post(server, "/completions", {"model": "tiny", "prompt": []})["param"] == "prompt"
    assert post(server, "/completions", {"model": "tiny", "prompt": [1, "a"]})["param"] == "prompt"
    assert post(server, "/completions", {"model": "tiny", "prompt": "x", "logprobs": 9})["param"] == "logprobs"
    assert post(server, "/nowhere", {}, expect=404)["code"] == "not_found"
    response = server.http.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()


def test_context_limits(server):
    long_prompt = {"model": "tiny", "prompt": [5] * 300, "max_tokens": 4}
    assert post(server, "/completions", long_prompt)["code"] == "context_length_exceeded"
    too_many = {"model": "tiny", "prompt": "Hello", "max_tokens": 1000}
    assert post(server, "/completions", too_many)["code"] == "context_length_exceeded"
    outside_vocab = {"model": "tiny", "prompt": [5, 10_000], "max_tokens": 4}
    error = post(server, "/completions", outside_vocab)
    assert "vocabulary" in error["message"] and error["param"] == "prompt"


def test_junk_in_every_field_is_never_a_500(server):
    fields = ["model", "messages", "max_tokens", "temperature", "top_p", "n", "stream", "stop", "seed", "logprobs",
              "top_logprobs", "top_k", "min_tokens", "repetition_penalty", "no_repeat_ngram_size", "num_beams",
              "length_penalty", "stream_options", "user"]
    junk = [None, -1, 1e30, "x", [], {}, [None], True, -0.5]
    for name in fields:
        for value in junk:
            body = chat(max_completion_tokens=2, **{name: value})
            response = server.http.post("/v1/chat/completions", json=body)
            assert response.status_code in (200, 400, 404), (name, value, response.text)
            if response.status_code != 200:
                assert "error" in response.json()
    assert server.http.get("/health").status_code == 200


def test_api_key_body_limit_and_full_queue(chat_generator):
    with serve(chat_generator, api_key="sekret", max_body_bytes=2000, max_queue=1) as server:
        assert post(server, "/chat/completions", chat(), expect=401)["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer nope"}
        assert post(server, "/chat/completions", chat(), headers=wrong, expect=401)["type"] == "authentication_error"
        key = {"Authorization": "Bearer sekret"}
        assert server.http.post("/v1/chat/completions", json=chat(), headers=key).status_code == 200
        assert server.http.get("/health").status_code == 200  # health needs no key
        big = chat(messages=[{"role": "user", "content": "x" * 5000}])
        assert post(server, "/chat/completions", big, headers=key, expect=413)["code"] == "request_too_large"

        def chunked():  # no Content-Length: the limit holds while reading
            yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
            yield b"y" * 5000
            yield b'"}]}'

        response = server.http.post("/v1/chat/completions", content=chunked(), headers=key)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        # four sequences at once into a queue of one
        response = server.http.post("/v1/chat/completions", json=chat(n=4, temperature=1.0), headers=key)
        assert response.status_code == 503 and response.headers["retry-after"]
        assert response.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 10  # the admitted choice is cancelled with the request
        while server.http.get("/health").json()["running_sequences"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.http.post("/v1/chat/completions", json=chat(), headers=key).status_code == 200
