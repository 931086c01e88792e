"""Scoring as an engine sequence (engine/scoring.py): every position's log-probability, computed in
the same steps as generating requests, each equal to the text scored alone (and to transformers)."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine.scoring import ScoringSequence
from fastdecode.errors import InvalidOptionError, PromptTooLongError
from engine_helpers import reference_logprobs
from tiny_models import VOCAB, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["llama-gqa", "mistral"])
def pair(request):
    torch.manual_seed(0)
    hf = build(request.param)
    return hf, fastdecode.from_hf(hf)


def _ids(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()  # [N-1, V]
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _scored_alone(gen, ids, top=0) -> ScoringSequence:
    engine = gen.engine(max_batch_tokens=8)
    sequence = engine.submit_scoring(ids, top)
    while engine.has_work():
        engine.step()
    return sequence


def test_scoring_equals_transformers_in_chunks(pair, monkeypatch):
    hf, gen = pair
    ids = _ids(40, 1)
    monkeypatch.setattr(ScoringSequence, "chunk_limit", 5)  # many chunks, the last one short
    sequence = _scored_alone(gen, ids)
    assert sequence.finished and len(sequence.logprobs) == len(ids) - 1
    torch.testing.assert_close(torch.tensor(sequence.logprobs), _hf_logprobs(hf, ids), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(gen.score(ids)), -_hf_logprobs(hf, ids), atol=1e-4, rtol=0)


def test_top_logprobs_equal_the_reference_pass(pair):
    _, gen = pair
    ids = _ids(20, 2)
    sequence = _scored_alone(gen, ids, top=3)
    chosen, best = reference_logprobs(gen, ids, 3)
    torch.testing.assert_close(torch.tensor(sequence.logprobs), torch.tensor(chosen), atol=1e-5, rtol=0)
    assert [[t for t, _ in row] for row in sequence.top] == [[t for t, _ in row] for row in best]
    torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in sequence.top]),
                               torch.tensor([[v for _, v in row] for row in best]), atol=1e-5, rtol=0)


def test_scoring_beside_greedy_requests_each_equal_to_alone(pair):
    """Scoring texts and greedy requests arrive at different steps of one engine: every score and
    every generated token is what it is alone; the engine ends with every block free."""
    _, gen = pair
    texts = [_ids(n, 10 + n) for n in (23, 6, 41)]
    prompts = [(_ids(n, 20 + n), {"max_new_tokens": m}) for n, m in ((9, 7), (30, 5), (4, 9))]
    texts_alone = [_scored_alone(gen, ids).logprobs for ids in texts]
    greedy_alone = []
    for prompt, options in prompts:
        engine = gen.engine(max_batch_tokens=8)
        greedy_alone.append(engine.submit(prompt, options))
        while engine.has_work():
            engine.step()
    engine = gen.engine(max_batch_tokens=8)
    arrivals = {0: [("score", texts[0]), ("generate", prompts[0])], 2: [("generate", prompts[1])],
                3: [("score", texts[1]), ("score", texts[2])], 6: [("generate", prompts[2])]}
    scored, generated, step = [], [], 0
    while arrivals or engine.has_work():
        for kind, request in arrivals.pop(step, []):
            if kind == "score":
                scored.append(engine.submit_scoring(request))
            else:
                generated.append(engine.submit(*request))
        engine.step()
        step += 1
    for together, alone in zip(scored, texts_alone):
        assert together.finished and together.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(together.logprobs), torch.tensor(alone), atol=1e-5, rtol=0)
    assert [s.output_ids for s in generated] == [s.output_ids for s in greedy_alone]
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_a_cancelled_scoring_sequence_frees_its_blocks(pair):
    _, gen = pair
    engine = gen.engine(max_batch_tokens=8)
    sequence = engine.submit_scoring(_ids(50, 3))
    engine.step()
    engine.step()
    assert 0 < len(sequence.logprobs) < 49
    sequence.cancel()
    (event,) = engine.step()
    assert event.finish_reason == "cancelled" and not engine.has_work()
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks


def test_bad_scoring_requests_are_refused(pair):
    hf, gen = pair
    engine = gen.engine()
    with pytest.raises(InvalidOptionError, match="at least two tokens"):
        engine.submit_scoring([5])
    with pytest.raises(InvalidOptionError, match="top_logprobs"):
        engine.submit_scoring([5, 6], -1)
    with pytest.raises(InvalidOptionError, match="vocabulary"):
        engine.submit_scoring([5, VOCAB])
    with pytest.raises(PromptTooLongError):
        engine.submit_scoring([5] * (hf.config.max_position_embeddings + 1))
    streamed = gen.requests.generation_config({"n_ctx": 16, "max_new_tokens": 0})
    with pytest.raises(InvalidOptionError, match="vocabulary"):  # through a stream: any length, but real ids
        engine.submit_scoring([5, VOCAB], 0, streamed)
    assert not engine.has_work()
