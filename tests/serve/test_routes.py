"""The routes clients expect besides completions: model lookup and aliases (any name unless
strict), llama.cpp's /tokenize and /detokenize, /v1/health, CORS for allowed origins only, and an
x-request-id on every response; through the real clients (openai, LangChain) on a real server."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, serve, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
QUESTION = [{"role": "user", "content": "Hi"}]


def test_models_retrieve_and_aliases(chat_generator):
    with serve(chat_generator, model_aliases=("gpt-4o-mini", "other")) as running:
        client = running.client()
        assert [m.id for m in client.models.list().data] == ["tiny", "gpt-4o-mini", "other"]
        assert client.models.retrieve("other").id == "other"
        assert client.models.retrieve("tiny").model_extra["max_model_len"] == 256
        answer = client.chat.completions.create(model="gpt-4o-mini", messages=QUESTION, max_tokens=3, temperature=0)
        assert answer.model == "gpt-4o-mini"
        # a one-model server answers any name, with its own
        answer = client.chat.completions.create(model="gpt-3.5-turbo", messages=QUESTION, max_tokens=3,
                                                temperature=0)
        assert answer.model == "tiny"
        assert answer.choices[0].message.content == chat_generator.generate(QUESTION, max_new_tokens=3)
        assert client.models.retrieve("unknown").id == "tiny"


def test_strict_model_name_refuses_other_names(chat_generator):
    with serve(chat_generator, strict_model_name=True) as running:
        client = running.client()
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="gpt-3.5-turbo", messages=QUESTION, max_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-3.5-turbo")
        assert client.models.retrieve("tiny").id == "tiny"


def test_langchain_chat_openai_with_no_model_name(server, chat_generator):
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(base_url=server.url, api_key="unused", temperature=0, max_tokens=4,
                                       max_retries=0)
    reply = chat.invoke("Hi")
    assert reply.content == chat_generator.generate([{"role": "user", "content": "Hi"}], max_new_tokens=4)


def test_tokenize_and_detokenize(server, chat_generator):
    tokenizer = chat_generator.tokenizer
    text = "Hello, how are you?"
    ids = server.http.post("/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    special = server.http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    assert special == tokenizer.encode(text, add_special_tokens=True)
    pieces = server.http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert server.http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    for path, body, param in (("/tokenize", {"content": 5}, "content"), ("/tokenize", {"text": "x"}, "text"),
                              ("/detokenize", {"tokens": [10 ** 6]}, "tokens")):
        answer = server.http.post(path, json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_token_routes_need_the_key(chat_generator):
    with serve(chat_generator, api_key="sekret") as running:
        assert running.http.post("/tokenize", json={"content": "Hi"}).status_code == 401
        answer = running.http.post("/tokenize", json={"content": "Hi"}, headers={"Authorization": "Bearer sekret"})
        assert answer.status_code == 200


def test_v1_health(server):
    assert server.http.get("/v1/health").json()["status"] == "ok"


def test_request_id_on_every_response(server):
    for response in (server.http.get("/v1/models"), server.http.get("/nowhere"),
                     server.http.post("/v1/completions", json={"model": "tiny"})):
        assert len(response.headers["x-request-id"]) == 32
    assert server.http.get("/health", headers={"x-request-id": "abc-123"}).headers["x-request-id"] == "abc-123"
    with server.http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2,
                                                            "stream": True}) as streamed:
        assert streamed.headers["x-request-id"]


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


def test_cors_for_allowed_origins_only(chat_generator, server):
    allowed, other = "http://localhost:5173", "http://evil.example"
    # default: no origin is allowed
    default = server.http.options("/v1/chat/completions", headers={"Origin": allowed, **PREFLIGHT})
    assert "access-control-allow-origin" not in default.headers
    with serve(chat_generator, allowed_origins=(allowed,), api_key="sekret") as running:
        ok = running.http.options("/v1/chat/completions", headers={"Origin": allowed, **PREFLIGHT})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
        assert "POST" in ok.headers["access-control-allow-methods"]
        refused = running.http.options("/v1/chat/completions", headers={"Origin": other, **PREFLIGHT})
        assert "access-control-allow-origin" not in refused.headers
        answer = running.http.post("/v1/chat/completions", headers={"Origin": allowed, "Authorization": "Bearer sekret"},
                                   json={"model": "tiny", "messages": QUESTION, "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == allowed
        assert "access-control-allow-origin" not in running.http.get("/health", headers={"Origin": other}).headers


def test_request_id_on_internal_errors(chat_generator, monkeypatch):
    with serve(chat_generator) as running:
        def broken(_request):
            raise RuntimeError("a bug")

        monkeypatch.setattr(running.service, "encode", broken)
        answer = running.http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                                   headers={"x-request-id": "trace-7"})
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "internal_error"
        assert answer.headers["x-request-id"] == "trace-7"
