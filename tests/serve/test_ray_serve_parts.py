"""The pieces of `fastdecode serve --ray` that need no Ray cluster (tests/serve/test_ray_serve.py runs
the whole service): a replica answers through the single server's own application (every model
kind: the chat model and tiny BART), a client that goes away stops its generation, the routing
text, the replica options and flags, the Serve config builder and the gathered metrics."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from click.testing import CliRunner

from serve_helpers import chat_generator, serve, server, tiny_bart_generator  # noqa: F401 (fixtures)

from fastdecode.cli import main
from fastdecode.errors import InvalidOptionError
from fastdecode.integrations.ray_serve import ReplicaOptions
from fastdecode.integrations.ray_serve.forwarding import (ForwardedRequest, HostedApp, ReplicaIdentity, ResponseHead,
                                                          routing_text)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
IDENTITY = ReplicaIdentity("r1", "127.0.0.1", 1234)


def forwarded(path: str, body: dict | None = None, method: str = "POST") -> ForwardedRequest:
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    return ForwardedRequest(method, path, b"", headers, raw)


async def answer(hosted: HostedApp, request: ForwardedRequest) -> tuple[ResponseHead, bytes]:
    items = [item async for item in hosted.handle(request, IDENTITY)]
    assert isinstance(items[0], ResponseHead) and items[0].identity == IDENTITY
    assert all(isinstance(item, bytes) for item in items[1:])
    return items[0], b"".join(items[1:])


def hosted_app(generator, **settings) -> HostedApp:
    from fastdecode.serve import ServeSettings, create_app

    return HostedApp(create_app(generator, ServeSettings(model_name="tiny", **settings)))


def sse_text(body: bytes, endpoint: str) -> str:
    text = ""
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["text"] if endpoint == "completion" else choice["delta"].get("content", "")
    return text


def test_a_replica_answers_as_the_single_server(server, chat_generator):
    """The same request through the replica's hosted app and through `fastdecode serve`: the same
    texts, usage and errors; streamed as it streams; every route (GET ones and 404s included)."""
    requests = [("/v1/chat/completions", {"model": "tiny", "messages": QUESTION, "max_tokens": 10, "temperature": 0}),
                ("/v1/completions", {"model": "tiny", "prompt": ["Hello there", "A cat sat"], "max_tokens": 8,
                                     "temperature": 0, "n": 2, "num_beams": 2}),
                ("/v1/chat/completions", {"model": "tiny", "messages": "Hi"})]

    async def run() -> None:
        hosted = hosted_app(chat_generator)
        await hosted.start()
        try:
            for path, body in requests:
                head, raw = await answer(hosted, forwarded(path, body))
                direct = server.http.post(path, json=body)
                assert head.status == direct.status_code
                ours, theirs = json.loads(raw), direct.json()
                for response in (ours, theirs):
                    response.pop("id", None), response.pop("created", None)
                assert ours == theirs
            body = {"model": "tiny", "messages": QUESTION, "max_tokens": 10, "temperature": 0, "stream": True}
            head, raw = await answer(hosted, forwarded("/v1/chat/completions", body))
            assert head.status == 200 and (b"content-type", b"text/event-stream; charset=utf-8") in head.headers
            assert sse_text(raw, "chat") == chat_generator.generate(QUESTION, max_new_tokens=10)
            assert raw.endswith(b"data: [DONE]\n\n")
            for path, status in (("/v1/models", 200), ("/health", 200), ("/", 200), ("/nowhere", 404)):
                head, raw = await answer(hosted, forwarded(path, method="GET"))
                direct = server.http.get(path)
                assert head.status == direct.status_code == status
                if path not in ("/", "/v1/models"):  # the page is the same; model lists carry their time
                    assert json.loads(raw) == direct.json()
        finally:
            await hosted.stop()

    asyncio.run(run())


def test_an_encoder_decoder_replica_answers_as_offline():
    bart = tiny_bart_generator()
    body = {"model": "tiny", "prompt": "A cat sat on the mat", "max_tokens": 8, "temperature": 0}
    offline = bart.generate("A cat sat on the mat", max_new_tokens=8)

    async def run() -> None:
        hosted = hosted_app(bart)
        await hosted.start()
        try:
            head, raw = await answer(hosted, forwarded("/v1/completions", body))
            assert head.status == 200
            assert json.loads(raw)["choices"][0]["text"] == offline
            head, raw = await answer(hosted, forwarded("/v1/completions", {**body, "stream": True}))
            assert sse_text(raw, "completion") == offline
            head, raw = await answer(hosted, forwarded("/v1/chat/completions", {"model": "tiny", "messages": QUESTION}))
            assert head.status == 400 and json.loads(raw)["error"]["code"] == "unsupported_model"
        finally:
            await hosted.stop()

    asyncio.run(run())


def test_the_ingress_going_away_stops_the_generation(chat_generator):
    """Closing a replica's response mid-stream (the client or the ingress left) cancels its sequences."""
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 200, "temperature": 0, "stream": True}

    async def run() -> None:
        hosted = hosted_app(chat_generator)
        await hosted.start()
        service = hosted.app.state.service
        try:
            response = hosted.handle(forwarded("/v1/completions", body), IDENTITY)
            assert isinstance(await response.__anext__(), ResponseHead)
            assert b"data: " in await response.__anext__()
            await response.aclose()
            deadline = time.monotonic() + 10
            while service.active_sequences() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert service.active_sequences() == 0
        finally:
            await hosted.stop()

    asyncio.run(run())


def test_routing_text_keeps_a_conversation_s_prefix():
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = first + [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And?"}]
    assert routing_text("chat", [later]).startswith(routing_text("chat", [first]))
    other = [{"role": "user", "content": "Different"}]
    assert routing_text("chat", [other])[0] != routing_text("chat", [first])[0]  # conversations part at once
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert "Hi" in routing_text("chat", [parts])
    assert routing_text("completion", [[5, 6, 7, 8]]).startswith(routing_text("completion", [[5, 6, 7]]))
    assert routing_text("completion", ["Hello there", "x"]) == "Hello there"
    assert routing_text("completion", [""]) is None and routing_text("completion", []) is None


def test_replica_options():
    assert ReplicaOptions().deployment_options() == {"ray_actor_options": {"num_cpus": 1},
                                                     "max_ongoing_requests": 64, "num_replicas": 1}
    scaled = ReplicaOptions(min_replicas=2, max_replicas=4, target_ongoing_requests=3, cpus_per_replica=2)
    assert scaled.deployment_options()["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 4,
                                                                 "target_ongoing_requests": 3}
    assert scaled.most_replicas == 4 and ReplicaOptions(max_replicas=3).deployment_options()[
        "autoscaling_config"]["min_replicas"] == 1
    for bad, message in [(dict(replicas=2, max_replicas=3), "not both"), (dict(min_replicas=2), "needs --max-replicas"),
                         (dict(min_replicas=3, max_replicas=2), "below"), (dict(replicas=0), "--replicas must be"),
                         (dict(target_ongoing_requests=2), "needs --max-replicas"),
                         (dict(max_replicas=2, target_ongoing_requests=0), "> 0"),
                         (dict(routing="random"), "--routing must be"), (dict(cpus_per_replica=0), "--cpus-per")]:
        with pytest.raises(InvalidOptionError, match=message):
            ReplicaOptions(**bad)


def test_serve_ray_flags_are_checked_before_anything_starts(tmp_path):
    def run(*args):
        return CliRunner().invoke(main, ["serve", *args])

    result = run("--replicas", "2", "--routing", "prefix")
    assert result.exit_code == 2 and "--replicas, --routing only apply with --ray" in result.stderr
    result = run("--ray", "--replicas", "2", "--max-replicas", "3")
    assert result.exit_code == 2 and "not both" in result.stderr
    result = run("--ray", "-m", str(tmp_path / "none"))
    assert result.exit_code == 2 and "does not exist" in result.stderr and "Traceback" not in result.output


def test_app_builder_for_serve_config_files(tmp_path):
    pytest.importorskip("ray.serve")
    from fastdecode.integrations.ray_serve import app_builder

    app = app_builder({"model": str(tmp_path), "replicas": "2", "routing": "power-of-two", "api_key": "123",
                       "max_batch_tokens": "512", "n_ctx": "None"})
    ingress = app._bound_deployment
    model = ingress.init_args[0]
    assert model._bound_deployment.num_replicas == 2 and ingress.init_args[1].api_key == "123"
    assert model._bound_deployment.init_args[1].api_key is None  # the ingress checks it, the only way in
    assert model._bound_deployment.init_args[1].max_batch_tokens == 512
    with pytest.raises(InvalidOptionError, match="unknown argument 'replica'"):
        app_builder({"replica": 2})
    with pytest.raises(InvalidOptionError, match="must be a number"):
        app_builder({"replicas": "two"})


def test_gathered_metrics_label_each_replica():
    from fastdecode.integrations.ray_serve.metrics import IngressMetrics
    from fastdecode.serve.metrics import ServerMetrics

    first, second = ServerMetrics(), ServerMetrics()
    first.generated_tokens.inc(3)
    second.generated_tokens.inc(5)
    second.requests.labels(endpoint="/v1/completions", status="200").inc()
    ingress = IngressMetrics()
    ingress.retries.inc()
    text = ingress.render({"a": first.render().decode(), "b": second.render().decode()}).decode()
    assert 'fastdecode_generated_tokens_total{replica="a"} 3.0' in text
    assert 'fastdecode_generated_tokens_total{replica="b"} 5.0' in text
    assert 'fastdecode_requests_total{endpoint="/v1/completions",replica="b",status="200"} 1.0' in text
    assert "fastdecode_ingress_retries_total 1.0" in text
    assert text.count("# TYPE fastdecode_generated_tokens_total counter") == 1  # one family, both replicas


# -- the ingress's own app, with its replica handle replaced by a hosted app in this process --------
class LocalReplicas:
    """Stands in for the model deployment's handle (``options``, ``handle.remote``): each call runs
    through one hosted app; the requests that reached it are kept."""

    def __init__(self, hosted: HostedApp):
        self.hosted, self.received = hosted, []
        self.handle = self

    def options(self, stream: bool) -> "LocalReplicas":
        return self

    def remote(self, request: ForwardedRequest) -> "LocalResponses":
        self.received.append(request)
        return LocalResponses(self.hosted.handle(request, IDENTITY))


class LocalResponses:
    def __init__(self, items):
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.items.aclose())


def run_through_ingress(generator, settings: dict, talk) -> None:
    """``talk(http, replicas)`` against the ingress's app (httpx in process) in front of ``generator``."""
    pytest.importorskip("ray.serve")
    import httpx

    from fastdecode.integrations.ray_serve.ingress import Ingress, build_app
    from fastdecode.serve import ServeSettings

    async def run() -> None:
        settings_ = ServeSettings(model_name="tiny", **settings)
        replica_settings = ServeSettings(model_name="tiny", **{**settings, "allowed_origins": ()})
        from fastdecode.serve import create_app

        hosted = HostedApp(create_app(generator, replica_settings))
        await hosted.start()
        try:
            replicas = LocalReplicas(hosted)
            ingress = object.__new__(Ingress)
            Ingress.__bases__[0].__init__(ingress, replicas, settings_)  # the class under Serve's wrapper
            transport = httpx.ASGITransport(app=build_app(ingress))
            async with httpx.AsyncClient(transport=transport, base_url="http://ingress", timeout=60) as http:
                await talk(http, replicas)
        finally:
            await hosted.stop()

    asyncio.run(run())


def events_of(body: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]


def test_the_ingress_forwards_issue_32_s_routes_and_options(chat_generator):
    """/v1/responses, /v1/messages (plain and streamed), /v1/embeddings, /tokenize, /detokenize,
    /v1/models/{id}, any model name, --lenient, CORS and x-request-id: answered through the ingress
    as `fastdecode serve` answers them, the generation routes routed by their conversation's text."""
    expected = chat_generator.generate(QUESTION, max_new_tokens=6)
    settings = dict(model_aliases=("alias",), allowed_origins=("http://app.test",), lenient=True, embeddings="mean")

    async def talk(http, replicas) -> None:
        answer = await http.post("/v1/responses", json={"model": "gpt-4o", "input": QUESTION[0]["content"],
                                                        "max_output_tokens": 6, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["output"][0]["content"][0]["text"] == expected
        assert replicas.received[-1].prompt == routing_text("chat", [QUESTION])  # routed by its conversation
        streamed = await http.post("/v1/responses", json={"input": QUESTION, "max_output_tokens": 6,
                                                          "temperature": 0, "stream": True})
        events = events_of(streamed.text)
        assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected
        message = {"model": "alias", "max_tokens": 6, "temperature": 0, "messages": QUESTION}
        answer = await http.post("/v1/messages", json=message, headers={"x-api-key": "unused"})
        assert answer.status_code == 200 and answer.json()["content"][0]["text"] == expected
        assert answer.json()["model"] == "alias"
        streamed = await http.post("/v1/messages", json={**message, "stream": True})
        assert "".join(e["delta"]["text"] for e in events_of(streamed.text)
                       if e["type"] == "content_block_delta") == expected
        assert replicas.received[-1].prompt == routing_text("chat", [QUESTION])
        # --lenient: an unknown field is ignored, at the ingress and on the replica
        chat = await http.post("/v1/chat/completions", json={"model": "tiny", "messages": QUESTION, "max_tokens": 6,
                                                             "temperature": 0, "vendor_extra": 1})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == expected
        embedded = await http.post("/v1/embeddings", json={"input": ["a cat", "a dog"]})
        assert embedded.status_code == 200 and len(embedded.json()["data"]) == 2
        assert replicas.received[-1].prompt is None  # nothing to match: by load
        tokens = (await http.post("/tokenize", json={"content": "Hello there"})).json()["tokens"]
        assert tokens == chat_generator.tokenizer.encode("Hello there")
        assert (await http.post("/detokenize", json={"tokens": tokens})).json() == {"content": "Hello there"}
        assert (await http.get("/v1/models/alias")).json()["id"] == "alias"
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == ["tiny", "alias"]
        # CORS: a preflight from the allowed origin gets the headers, from another none; answered at the ingress
        sent = len(replicas.received)
        preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        allowed = await http.options("/v1/chat/completions", headers={"Origin": "http://app.test", **preflight})
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://app.test"
        other = await http.options("/v1/chat/completions", headers={"Origin": "http://evil.test", **preflight})
        assert "access-control-allow-origin" not in other.headers and len(replicas.received) == sent
        simple = await http.post("/tokenize", json={"content": "x"}, headers={"Origin": "http://app.test"})
        assert simple.headers["access-control-allow-origin"] == "http://app.test"
        assert simple.headers.get_list("access-control-allow-origin") == ["http://app.test"]  # once, not per hop
        # x-request-id: the client's own, sent on to the replica; else one the ingress made, the same on both
        mine = await http.post("/tokenize", json={"content": "x"}, headers={"x-request-id": "req-42"})
        assert mine.headers.get_list("x-request-id") == ["req-42"]
        assert dict(replicas.received[-1].headers)[b"x-request-id"] == b"req-42"
        made = await http.post("/tokenize", json={"content": "x"})
        assert dict(replicas.received[-1].headers)[b"x-request-id"] == made.headers["x-request-id"].encode()

    run_through_ingress(chat_generator, settings, talk)


def test_the_ingress_refuses_bad_requests_before_a_replica(chat_generator):
    """Strict model names and no --lenient: the new routes' bad requests are answered by the ingress
    in their API's error shape (Anthropic's on /v1/messages), and never reach a replica."""

    async def talk(http, replicas) -> None:
        bad = [("/v1/messages", {"model": "other", "max_tokens": 4, "messages": QUESTION}, 404, None),
               ("/v1/messages", {"model": "tiny", "messages": QUESTION}, 400, None),
               ("/v1/responses", {"input": "Hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
               ("/v1/responses", {"input": "Hi", "model": "other"}, 404, "model"),
               ("/v1/chat/completions", {"messages": QUESTION, "vendor_extra": 1}, 400, "vendor_extra"),
               ("/v1/completions", {"prompt": "Hi", "model": "gpt-3.5-turbo"}, 404, "model")]
        for path, body, status, param in bad:
            answer = await http.post(path, json=body)
            assert answer.status_code == status, (path, answer.text)
            if path == "/v1/messages":
                assert answer.json()["type"] == "error" and answer.json()["error"]["type"] in (
                    "not_found_error", "invalid_request_error")
            else:
                assert answer.json()["error"]["param"] == param
        assert replicas.received == []
        assert (await http.get("/v1/models/other")).status_code == 404  # the replica's answer, strict too

    run_through_ingress(chat_generator, {"strict_model_name": True}, talk)


def test_a_stream_cut_by_a_lost_replica_ends_in_its_api_s_error_event():
    pytest.importorskip("ray.serve")
    from fastdecode.integrations.ray_serve.ingress import _event, replica_lost

    lost = replica_lost(RuntimeError("gone"))

    def data(event: bytes) -> dict:
        return json.loads(event.decode().split("data: ", 1)[1])

    messages, responses, chat = (_event(lost, path) for path in ("/v1/messages", "/v1/responses",
                                                                 "/v1/chat/completions"))
    assert messages.startswith(b"event: error\n") and data(messages) == {
        "type": "error", "error": {"type": "overloaded_error", "message": lost.message}}  # Anthropic's shape
    assert responses.startswith(b"event: error\n") and data(responses)["code"] == "replica_unavailable"
    assert data(chat)["error"]["code"] == "replica_unavailable"
