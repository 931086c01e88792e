"""Embedding sequences of the engine (engine/embedding_rows.py): chunked, batched and beside greedy
generation, each equals the text embedded alone and the no-cache reference (1e-5); the generation
beside them stays token-identical; a cancelled one frees its blocks; bad input is refused typed."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from embedding_reference import reference_embeddings
from fastdecode.engine.embedding_rows import forward_outputs, submit_embedding
from fastdecode.errors import InvalidOptionError, PromptTooLongError
from tiny_models import VOCAB, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama-gqa", "mistral"])
def gen(request):
    torch.manual_seed(0)
    return fastdecode.from_hf(build(request.param))


def _ids(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine) -> None:
    while engine.has_work():
        engine.step()


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_chunked_and_batched_equal_the_reference(gen, pooling):
    texts = [_ids(n, n) for n in (23, 1, 9, 41)]
    engine = gen.engine(max_batch_tokens=8)  # chunks of at most 8 tokens, several texts per step
    sequences = [submit_embedding(engine, ids, pooling) for ids in texts]
    _run(engine)
    for sequence, ids in zip(sequences, texts):
        assert sequence.finished and sequence.finish_reason == "length" and sequence.output_ids == []
        torch.testing.assert_close(sequence.embedding, reference_embeddings(gen.model, [ids], pooling)[0],
                                   atol=1e-5, rtol=0)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_embeddings_beside_greedy_requests_leave_generation_unchanged(gen, monkeypatch):
    """Embedding texts and greedy requests arrive at random steps of one engine: every generated token
    is what it is alone, every embedding the reference's; the engine ends with every block free."""
    import random

    rng = random.Random(7)
    texts = [(_ids(rng.randint(1, 30), 100 + i), rng.choice(["mean", "last"])) for i in range(6)]
    prompts = [(_ids(rng.randint(1, 20), 200 + i), {"max_new_tokens": rng.randint(2, 9)}) for i in range(4)]
    greedy_alone = []
    for prompt, options in prompts:
        engine = gen.engine(max_batch_tokens=8)
        greedy_alone.append(engine.submit(prompt, options))
        _run(engine)
    arrivals: dict[int, list] = {}
    for item in [("embed", t) for t in texts] + [("generate", (i, p)) for i, p in enumerate(prompts)]:
        arrivals.setdefault(rng.randint(0, 8), []).append(item)
    from fastdecode.engine import runner

    mixed = []  # steps whose forward returned hidden states and logits both

    def watched(model, tokens, positions, plan, logits_at, layout):
        mixed.append(bool(layout.hidden_rows) and logits_at.numel() > 0)
        return forward_outputs(model, tokens, positions, plan, logits_at, layout)

    monkeypatch.setattr(runner, "forward_outputs", watched)
    engine = gen.engine(max_batch_tokens=8)
    embedded, generated, step = [], {}, 0
    while arrivals or engine.has_work():
        for kind, request in arrivals.pop(step, []):
            if kind == "embed":
                embedded.append((submit_embedding(engine, *request), request))
            else:
                index, (prompt, options) = request
                generated[index] = engine.submit(prompt, options)
        engine.step()
        step += 1
    assert [generated[i].output_ids for i in range(len(prompts))] == [s.output_ids for s in greedy_alone]
    for sequence, (ids, pooling) in embedded:
        torch.testing.assert_close(sequence.embedding, reference_embeddings(gen.model, [ids], pooling)[0],
                                   atol=1e-5, rtol=0)
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    assert sum(mixed) >= 3, mixed


def test_a_cancelled_embedding_frees_its_blocks(gen):
    engine = gen.engine(max_batch_tokens=8)
    sequence = submit_embedding(engine, _ids(50, 3))
    engine.step()
    engine.step()
    assert engine.cache.pool.num_free < engine.cache.pool.num_blocks
    sequence.cancel()
    (event,) = engine.step()
    assert event.finish_reason == "cancelled" and event.token_id is None and not engine.has_work()
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    with pytest.raises(InvalidOptionError, match="once the sequence has run"):
        sequence.embedding


def test_bad_embedding_requests_are_refused(gen):
    engine = gen.engine()
    with pytest.raises(InvalidOptionError, match="empty"):
        submit_embedding(engine, [])
    with pytest.raises(InvalidOptionError, match="vocabulary"):
        submit_embedding(engine, [5, VOCAB])
    with pytest.raises(InvalidOptionError, match="pooling"):
        submit_embedding(engine, [5, 6], "cls")
    with pytest.raises(PromptTooLongError):
        submit_embedding(engine, [5] * (gen.config.max_position_embeddings + 1))
    with pytest.raises(PromptTooLongError, match="cache"):
        submit_embedding(gen.engine(cache_tokens=16), [5] * 40)
    assert not engine.has_work()
    for bad in ([], 5, [[1, 2], "x".encode()], [1.5, 2], None):
        with pytest.raises(InvalidOptionError):  # InvalidPromptError for the wrong types
            gen.embed(bad)


def test_an_encoder_decoder_model_is_refused():
    from tiny_encdec import build as build_encdec

    bart = fastdecode.from_hf(build_encdec("bart"))
    with pytest.raises(InvalidOptionError, match="decoder-only"):
        bart.embed([[5, 6, 7]])


def test_embeddings_in_steps_with_a_stream(gen):
    """A stream past n_ctx takes the mixed forward (engine/stream_steps.py): embeddings in its steps
    still get their hidden states, and the stream its tokens."""
    stream_prompt, options = _ids(30, 5), {"n_ctx": 20, "n_keep": 3, "policy": "shift", "max_new_tokens": 12}
    alone = gen.engine(max_batch_tokens=8)
    expected = alone.submit(stream_prompt, options)
    _run(alone)
    engine = gen.engine(max_batch_tokens=8)
    stream = engine.submit(stream_prompt, options)
    texts = [_ids(n, 300 + n) for n in (13, 4)]
    embedded = [submit_embedding(engine, ids, "mean") for ids in texts]
    _run(engine)
    assert stream.output_ids == expected.output_ids
    for sequence, ids in zip(embedded, texts):
        torch.testing.assert_close(sequence.embedding, reference_embeddings(gen.model, [ids])[0], atol=1e-5, rtol=0)
