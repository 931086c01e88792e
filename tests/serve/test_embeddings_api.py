"""POST /v1/embeddings through the `openai` client (its default base64 encoding and float): each input
an embedding sequence of the server's one engine (no thread of its own), equal to the no-cache
reference on the same tokens (tests/embedding_reference.py) beside generation; bad input gets an
OpenAI error object; refused without --embeddings."""

from __future__ import annotations

import threading

import pytest

from serve_helpers import chat_generator, serve, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
TEXTS = ["The capital of France is Paris.", "Hi", "A cat sat on the mat and looked at the moon."]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_create(chat_generator, pooling):
    import base64

    import numpy as np
    import torch

    from embedding_reference import reference_embeddings

    tokenizer = chat_generator.tokenizer
    expected = torch.stack([reference_embeddings(chat_generator.model, [tokenizer.encode(t)], pooling)[0]
                            for t in TEXTS])
    with serve(chat_generator, embeddings=pooling, max_batch_tokens=24) as running:  # chunks, shared steps
        client = running.client()
        for encoding in (None, "base64", "float"):  # None: the SDK asks for base64 and decodes it itself
            extra = {} if encoding is None else {"encoding_format": encoding}
            response = client.embeddings.create(model="tiny", input=TEXTS, **extra)
            rows = [d.embedding for d in sorted(response.data, key=lambda d: d.index)]
            if encoding == "base64":  # little-endian float32 bytes
                rows = [np.frombuffer(base64.b64decode(row), dtype="<f4").tolist() for row in rows]
            got = torch.tensor(rows)
            assert got.shape == (3, chat_generator.config.hidden_size)
            assert torch.allclose(got, expected, atol=1e-5)
            assert response.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in TEXTS)
        ids = tokenizer.encode(TEXTS[1])
        one = client.embeddings.create(model="tiny", input=ids)
        assert torch.allclose(torch.tensor(one.data[0].embedding), expected[1], atol=1e-5)
        assert not any(t.name == "fastdecode-embed" for t in threading.enumerate())  # the engine's thread runs them
        service = running.service
        assert service.worker.engine.cache.pool.num_free == service.worker.engine.cache.pool.num_blocks


def test_bad_input_gets_an_openai_error(chat_generator):
    with serve(chat_generator, embeddings="mean", n_ctx=16) as running:
        client = running.client()
        too_long = "word " * 40
        for bad, param in ((dict(input=[]), "input"), (dict(input=""), "input"), (dict(input=["ok", ""]), "input"),
                           (dict(input=too_long), "input"), (dict(input=[too_long, "ok"]), "input"),
                           (dict(input=5), "input"), (dict(input=[1.5, 2]), "input"), (dict(input=[[1, 2], "x", 3]), "input"),
                           (dict(input=[10 ** 9]), "input"), (dict(input="x", dimensions=3), "dimensions"),
                           (dict(input="x", encoding_format="int8"), "encoding_format")):
            with pytest.raises(openai.BadRequestError) as caught:
                client.embeddings.create(model="tiny", **bad)
            assert caught.value.body["param"] == param, bad
            assert caught.value.body["type"] == "invalid_request_error" and caught.value.body["message"]
        with pytest.raises(openai.BadRequestError, match="unknown field 'pooling'"):
            client.embeddings.create(model="tiny", input="x", extra_body={"pooling": "cls"})


def test_embeddings_need_the_flag(server):
    with pytest.raises(openai.BadRequestError, match="--embeddings"):
        server.client().embeddings.create(model="tiny", input="Hi")


def test_requests_beside_generation_each_get_their_own_vectors(chat_generator, monkeypatch):
    """Concurrent embedding requests (more inputs than a request may queue at once) and greedy
    completions on one server: every vector is the reference's, every completion what it is alone."""
    import asyncio

    import httpx
    import torch

    from embedding_reference import reference_embeddings
    from fastdecode.serve import embeddings

    monkeypatch.setattr(embeddings, "IN_FLIGHT", 2)  # the rest of a request's inputs follow as those end
    words = ["cat", "dog", "moon", "sun", "tree", "sea"]
    texts = [[f"{word} is a word number {i}" for i, word in enumerate(words[k:] + words[:k])] for k in range(3)]
    prompts = ["Once upon a time", "The weather today"]

    def complete(client_post, prompt):
        return client_post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                                    "temperature": 0})

    async def ask(base: str) -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"model": "tiny", "input": group})
                                             for group in texts),
                                           *(complete(client.post, prompt) for prompt in prompts))
        vectors = [[row["embedding"] for row in answer.json()["data"]] for answer in answers[:len(texts)]]
        return vectors, [answer.json()["choices"][0]["text"] for answer in answers[len(texts):]]

    with serve(chat_generator, embeddings="mean", max_batch_tokens=16) as running:
        alone = [running.client().completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)
                 .choices[0].text for p in prompts]
        got, completions = asyncio.run(ask(running.base))
    assert completions == alone
    tokenizer = chat_generator.tokenizer
    for group, vectors in zip(texts, got):
        for text, vector in zip(group, vectors):
            expected = reference_embeddings(chat_generator.model, [tokenizer.encode(text)])[0]
            assert torch.allclose(torch.tensor(vector), expected, atol=1e-5)


def test_a_client_going_away_cancels_every_input(monkeypatch):
    """The handler queues at most IN_FLIGHT inputs at once; a disconnect cancels them all (the engine
    frees a cancelled sequence's blocks: tests/unit/test_engine_embeddings.py) and answers nothing."""
    import asyncio

    from fastdecode.serve import embeddings

    monkeypatch.setattr(embeddings, "IN_FLIGHT", 2)

    class Worker:
        def __init__(self):
            self.submitted, self.cancelled = [], []

        def submit(self, submission):
            self.submitted.append(submission.index)

        def cancel(self, submission):
            self.cancelled.append(submission.index)

    class Lifetime:
        def on_disconnect(self, callback):
            self.gone = callback

    async def scenario(worker, lifetime):
        task = asyncio.create_task(embeddings.embed_on_engine(worker, [[1, 2]] * 5, "mean", lifetime))
        await asyncio.sleep(0.01)
        assert worker.submitted == [0, 1]  # the rest wait for these to end
        lifetime.gone()
        return await task

    worker, lifetime = Worker(), Lifetime()
    assert asyncio.run(scenario(worker, lifetime)) is None
    assert sorted(worker.cancelled) == [0, 1, 2, 3, 4]
