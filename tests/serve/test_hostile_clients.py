"""Issue 28 (hardening, round two), the server rows, through real servers on loopback with raw
sockets where a client library would hide the behaviour: a client that leaves a whole (not
streamed) answer or a beam search (run beside others in the engine), bodies the JSON parser cannot take, slow or incomplete
requests and too many connections, and a trailing slash with a forged Host header.

The model is the tiny chat model made slow (10 ms per forward), so that a request of 200 tokens
runs for seconds: long enough to see it cancelled, not finished."""

from __future__ import annotations

import json
import socket
import time

import pytest
from click.testing import CliRunner

from serve_helpers import serve, tiny_chat_generator

STEP_S = 0.01


@pytest.fixture(scope="module")
def slow_generator():
    generator = tiny_chat_generator(seed=3)
    forward = generator.model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(STEP_S)
        return forward(*args, **kwargs)

    generator.model.forward = slow_forward
    return generator


def request_bytes(path: str, body: dict, host: str = "127.0.0.1") -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode() + data


def answer(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (fails past ``timeout``). A reset
    ends it too: a server closing while a byte it has not read is in flight sends RST, not FIN."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def wait_for(condition, timeout: float, what: str) -> float:
    """Seconds until ``condition()`` holds; fails past ``timeout``."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, what
        time.sleep(0.005)
    return time.monotonic() - started


def generated(server) -> float:
    return server.service.metrics.generated_tokens._value.get()


def test_a_whole_answer_is_cancelled_when_its_client_leaves(slow_generator):
    """Row 1: a 200-token request (non-streamed, on both routes, n=2) stops within a few steps of the
    disconnect, and every block of the cache is free again."""
    with serve(slow_generator) as server:
        pool = server.service.worker.engine.cache.pool
        for path, body in (("/v1/completions", {"prompt": "hello", "max_tokens": 200, "n": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 200})):
            before = generated(server)
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(request_bytes(path, {**body, "temperature": 0}))
                wait_for(lambda: generated(server) - before >= 10, 10, "the request never started")
            left_at = generated(server)
            freed_in = wait_for(lambda: server.service.active_sequences() == 0, 2, f"{path}: still running")
            assert pool.num_free == pool.num_blocks, path
            assert freed_in < 0.5 and generated(server) - left_at < 20, (path, freed_in)
        assert server.http.get("/health").json()["running_sequences"] == 0


def test_beam_search_runs_beside_others_and_is_cancelled_on_disconnect(slow_generator):
    """Row 2: beam requests are engine submissions: while a long beam search runs, a second one is
    answered beside it (no beam thread serializes them), as offline; when the long one's client
    leaves, its group stops within a few steps and every block of the cache is free again."""
    with serve(slow_generator, max_queue=1) as server:
        pool = server.service.worker.engine.cache.pool
        long_beam = {"prompt": "hello", "max_tokens": 240, "min_tokens": 240, "num_beams": 4}
        short_beam = {"prompt": "hi", "max_tokens": 2, "num_beams": 2}
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(request_bytes("/v1/completions", long_beam))
            wait_for(lambda: server.service.active_sequences() == 1, 5, "the long search never started")
            time.sleep(0.1)  # it is running (240 steps, no end of text before: over 2.4 s)
            started = time.monotonic()
            response = server.http.post("/v1/completions", json=short_beam)
            assert response.status_code == 200, response.text
            assert time.monotonic() - started < 1.5, "the short search waited for the long one"
            assert server.service.active_sequences() == 1  # the long search still runs
            assert response.json()["choices"][0]["text"] == slow_generator.generate("hi", max_new_tokens=2,
                                                                                    num_beams=2)
        freed_in = wait_for(lambda: server.service.active_sequences() == 0, 2, "the abandoned search still runs")
        assert freed_in < 0.5
        wait_for(lambda: pool.num_free == pool.num_blocks, 1, "the abandoned search still holds blocks")


def test_should_stop_ends_a_generation_between_steps(slow_generator):
    """The hook the beam route cancels through: asked before every step, in the engine and in beam search."""
    from fastdecode.errors import GenerationCancelledError

    prompt = slow_generator.encode_prompt("hello")
    for beams in (1, 4):
        asked = []
        with pytest.raises(GenerationCancelledError):
            slow_generator.generate_ids_with_details([prompt], should_stop=lambda: asked.append(1) or len(asked) > 3,
                                                     num_beams=beams, max_new_tokens=50, min_new_tokens=50)
        assert len(asked) == 4, beams


def test_any_body_the_json_parser_cannot_take_is_a_400(slow_generator):
    """Row 3: a 5,000-digit integer and 100,000-deep nesting: 400 invalid_json naming the problem."""
    with serve(slow_generator) as server:
        for body, words in ((b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "digits"),
                            (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
                            (b'{"prompt": "x",}', "not valid JSON")):
            response = server.http.post("/v1/completions", content=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_json" and words in error["message"], error


def test_slow_and_incomplete_requests_are_closed_and_connections_bounded(slow_generator):
    """Row 4: a body shorter than its Content-Length gets 408 after --body-timeout; a connection that
    sends nothing is closed after --header-timeout; 40 connections
    sending their headers a byte at a time: the first --max-connections wait --header-timeout, then
    408 and closed; the others get 503 at once. The options are in `fastdecode serve --help`."""
    from fastdecode.cli import main

    help_text = CliRunner().invoke(main, ["serve", "--help"]).output
    for option in ("--header-timeout", "--body-timeout", "--keep-alive-timeout", "--max-connections"):
        assert option in help_text
    with serve(slow_generator, header_timeout=1.0, body_timeout=1.0, max_connections=8) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt"')
            started = time.monotonic()
            reply = answer(sock)
            assert reply.startswith(b"HTTP/1.1 408 ") and b"--body-timeout" in reply, reply
            assert 0.9 < time.monotonic() - started < 3

        with socket.create_connection(("127.0.0.1", server.port)) as sock:  # sends nothing: closed, no answer
            started = time.monotonic()
            assert answer(sock) == b"" and 0.9 < time.monotonic() - started < 3

        head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
        slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(40)]
        started = time.monotonic()
        for step in range(12):  # 3 s at 4 bytes/s
            for sock in slow:
                try:
                    sock.send(head[step:step + 1])
                except OSError:
                    pass  # closed by the server
            time.sleep(0.25)
        replies = [answer(sock, timeout=1.0) for sock in slow]  # each one is closed: recv ends
        for sock in slow:
            sock.close()
        statuses = sorted(reply.split(b" ")[1].decode() for reply in replies)
        assert statuses == ["408"] * 8 + ["503"] * 32, statuses
        assert all(b'"error"' in reply for reply in replies)
        assert server.http.get("/health").status_code == 200


def test_a_trailing_slash_is_a_404_never_a_redirect_from_the_host_header(slow_generator):
    """Row 5: POST /v1/completions/ with Host: evil.example: a 404 error object, no Location."""
    with serve(slow_generator) as server:
        for request in (request_bytes("/v1/completions/", {"prompt": "x"}, host="evil.example"),
                        b"GET /health/ HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(request)
                reply = answer(sock)
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404 ") and b"location" not in head.lower(), head
            assert json.loads(body)["error"]["code"] == "not_found"
