"""Draft-model speculation (engine/draft_model.py): a smaller model with the same tokenizer drafts,
the target verifies; outputs equal decoding without speculation (greedy and seeded sampling),
alone and batched, and every block of both caches is free at the end; a draft model with another
vocabulary is refused with a typed error."""

from __future__ import annotations

import pytest

import fastdecode
from fastdecode.engine.draft_model import DraftModelMismatchError
from engine_helpers import run_arrivals
from tiny_models import save_tiny_folder, save_word_tokenizer

pytest.importorskip("transformers")

PROMPT = [5, 9, 11, 5, 9, 11, 40, 41, 42, 5, 9]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    save_tiny_folder(root / "target", "llama-gqa")
    save_tiny_folder(root / "other", "llama-mha", seed=3)  # another random model: most drafts rejected
    save_tiny_folder(root / "wrong-vocab", "llama-mha")
    save_word_tokenizer(root / "wrong-vocab", vocab_size=50)
    return root


def _engine_run(gen, requests):
    engine = gen.engine(max_batch_tokens=64)
    outputs = run_arrivals(engine, {0: requests[:2], 2: requests[2:]})
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks
    for runner in engine.speculator.runners.values():
        assert not runner.rows
        assert runner.engine.cache.pool.num_free == runner.engine.cache.pool.num_blocks
    return outputs, engine


@pytest.mark.parametrize("draft", ["target", "other"])
def test_draft_model_outputs_equal_plain_decoding(folders, draft):
    gen = fastdecode.load(folders / "target")
    spec = {"draft_model": str(folders / draft), "num_tokens": 3}
    requests = [(PROMPT, {"max_new_tokens": 20}),
                (PROMPT[2:], {"max_new_tokens": 16, "do_sample": True, "seed": 4, "top_k": 30}),
                (PROMPT[::-1], {"max_new_tokens": 18, "repetition_penalty": 1.2}),
                (PROMPT[:4], {"max_new_tokens": 12})]
    plain, _ = _engine_run(gen, requests)
    speculative = [(p, {**o, "speculative": spec}) for p, o in requests[:3]] + requests[3:]
    outputs, engine = _engine_run(gen, speculative)
    assert outputs == plain
    (runner,) = engine.speculator.runners.values()
    assert runner.tokens_drafted > 10  # the drafts did run


def test_same_model_as_draft_accepts_every_draft(folders):
    gen = fastdecode.load(folders / "target", speculative={"draft_model": str(folders / "target"), "num_tokens": 4})
    engine = gen.engine()
    sequence = engine.submit(PROMPT, {"max_new_tokens": 20})
    while engine.has_work():
        engine.step()
    assert sequence.output_ids == gen.generate_ids([PROMPT], max_new_tokens=20, speculative=False)[0]
    assert sequence.speculation.drafted == sequence.speculation.accepted > 10


def test_draft_model_with_another_vocabulary_is_refused(folders):
    gen = fastdecode.load(folders / "target")
    with pytest.raises(DraftModelMismatchError, match="another vocabulary"):
        gen.generate_ids([PROMPT], max_new_tokens=4, speculative={"draft_model": str(folders / "wrong-vocab")})
    with pytest.raises(fastdecode.errors.ModelNotFoundError):
        gen.generate_ids([PROMPT], max_new_tokens=4, speculative={"draft_model": str(folders / "missing")})


def test_serve_refuses_a_bad_draft_model_at_start(folders):
    from click.testing import CliRunner

    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["serve", "-m", str(folders / "target"), "--draft-model",
                                       str(folders / "wrong-vocab"), "--port", "1"])
    assert result.exit_code == 2 and "another vocabulary" in result.stderr, result.output


def test_one_sequence_drafts_alone_as_in_a_batched_step(folders):
    gen = fastdecode.load(folders / "target")
    engine = gen.engine()
    sequence = engine.submit(PROMPT, {"max_new_tokens": 12, "speculative": {"draft_model": str(folders / "target")}})
    engine.step()  # the prompt and the first token
    drafter = sequence.speculation.drafter
    alone = drafter.propose(3)
    expected = gen.generate_ids([PROMPT], max_new_tokens=4, speculative=False)[0][1:]
    assert alone == expected  # the model as its own draft proposes what it will generate
    sequence.cancel()
    engine.step()
    assert not drafter.runner.rows


def test_draft_sequences_read_the_prompt_chunk_by_chunk_with_the_target(folders):
    gen = fastdecode.load(folders / "target")
    engine = gen.engine(max_batch_tokens=4)  # the 11-token prompt runs in chunks of 4, 4, 3
    sequence = engine.submit(PROMPT, {"max_new_tokens": 12, "speculative": {"draft_model": str(folders / "target")}})
    runner = None
    while not sequence.output_ids:
        engine.step()
        (runner,) = engine.speculator.runners.values()
        assert runner.rows[sequence.id].num_computed == min(sequence.num_computed, len(PROMPT))  # in step
    assert runner.tokens_drafted == 0  # no draft forward ran yet: the prompt was read in the prompt's steps
    drafter = sequence.speculation.drafter
    expected = gen.generate_ids([PROMPT], max_new_tokens=4, speculative=False)[0][1:]
    assert drafter.propose(3) == expected  # the chunked draft cache holds the prompt's K/V
    sequence.cancel()
    engine.step()
    assert runner.engine.cache.pool.num_free == runner.engine.cache.pool.num_blocks
