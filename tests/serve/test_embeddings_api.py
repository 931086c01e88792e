"""POST /v1/embeddings through the `openai` client (its default base64 encoding and float), equal to
``generation.embedding`` on the same tokens; refused without --embeddings."""

from __future__ import annotations

import pytest

from serve_helpers import chat_generator, serve, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")
TEXTS = ["The capital of France is Paris.", "Hi", "A cat sat on the mat and looked at the moon."]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_create(chat_generator, pooling):
    import base64

    import numpy as np
    import torch

    from fastdecode.generation.embedding import embed_token_lists

    tokenizer = chat_generator.tokenizer
    expected = torch.stack([embed_token_lists(chat_generator.model, [tokenizer.encode(t)], pooling)[0] for t in TEXTS])
    with serve(chat_generator, embeddings=pooling, max_batch_tokens=24) as running:  # batches of a few inputs
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
        for bad, param in ((dict(input=[]), "input"), (dict(input="x", dimensions=3), "dimensions"),
                           (dict(input="x", encoding_format="int8"), "encoding_format")):
            with pytest.raises(openai.BadRequestError) as caught:
                client.embeddings.create(model="tiny", **bad)
            assert caught.value.body["param"] == param


def test_embeddings_need_the_flag(server):
    with pytest.raises(openai.BadRequestError, match="--embeddings"):
        server.client().embeddings.create(model="tiny", input="Hi")


def test_concurrent_requests_each_get_their_own_vectors(chat_generator):
    import asyncio

    import httpx
    import torch

    from fastdecode.generation.embedding import embed_token_lists

    texts = [f"{word} is a word number {i}" for i, word in enumerate(["cat", "dog", "moon", "sun", "tree", "sea"])]
    expected = [embed_token_lists(chat_generator.model, [chat_generator.tokenizer.encode(t)])[0] for t in texts]

    async def ask(base: str) -> list:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"model": "tiny", "input": [t]})
                                             for t in texts))
        return [answer.json()["data"][0]["embedding"] for answer in answers]

    with serve(chat_generator, embeddings="mean") as running:
        got = asyncio.run(ask(running.base))
    for vector, reference in zip(got, expected):
        assert torch.allclose(torch.tensor(vector), reference, atol=1e-5)
