"""Beam search vs transformers on tiny random decoder-only models (fp32): same sequences, same scores."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine.beam_group import BeamGroup
from tiny_models import VOCAB, build

pytest.importorskip("transformers")

# Nonzero (transformers fills finished beams with `pad or eos`), and a token these models do not emit:
# transformers counts left padding as tokens in n-gram blocking, fastdecode ignores padding.
PAD = 150
NEW = 12


@pytest.fixture(scope="module", params=["gpt2", "llama-gqa", "llama-mqa", "mistral", "gemma3", "bloom", "qwen3", "granite",
                                        "smollm3-nope-list", "olmo2",
                                        "phi3-longrope", "phi3-swa", "gemma2"])
def pair(request, tmp_path_factory):
    hf = build(request.param)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # sharper distributions: EOS candidates really compete with long beams
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, fastdecode.load(str(folder))


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=generator, device="cpu").tolist() for n in lengths]


def _eos_for(gen, prompts):
    """A token the model likes early on, so that beams really end (random tiny models have no EOS)."""
    return gen.generate_ids([prompts[1]], max_new_tokens=5)[0][4]


def _hf_beam(hf, prompts, **options):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, L - len(p):] = torch.tensor(p)
        mask[row, L - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, output_scores=True,
                          return_dict_in_generate=True, **options)
    return out.sequences[:, L:].tolist(), out.sequences_scores


def _check(hf, gen, prompts, **options):
    theirs, their_scores = _hf_beam(hf, prompts, **options)
    ours = gen.generate_ids_with_details(prompts, **options)
    assert len(ours) == len(theirs)
    width = len(theirs[0])
    for mine, ref in zip(ours, theirs):
        assert mine.tokens + [PAD] * (width - len(mine.tokens)) == ref, options
    torch.testing.assert_close(torch.tensor([r.score for r in ours]), their_scores.float(), atol=1e-4, rtol=0)
    return ours


@pytest.mark.parametrize("beams, length_penalty, early_stopping", [
    (2, 1.0, False), (4, 1.0, True), (4, 0.5, "never"), (4, 2.0, False), (2, 2.0, True), (4, 2.0, "never"),
])
def test_beam_search_matches_transformers(pair, beams, length_penalty, early_stopping):
    kind, hf, gen = pair
    prompts = _prompts((5, 11, 3))
    eos = _eos_for(gen, prompts)
    _check(hf, gen, prompts, num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
           max_new_tokens=NEW, eos_token_id=eos, num_return_sequences=2)


def test_some_beams_end_with_eos(pair):
    """The parity cases above exercise finished-hypothesis bookkeeping, not only length endings."""
    kind, hf, gen = pair
    prompts = _prompts((5, 11, 3))
    ours = _check(hf, gen, prompts, num_beams=4, length_penalty=0.5, early_stopping=True, max_new_tokens=NEW,
                  eos_token_id=_eos_for(gen, prompts), num_return_sequences=2)
    assert any(r.finish_reason == "eos" for r in ours)


@pytest.mark.parametrize("n", [2, 3])
def test_beam_search_with_ngram_blocking_matches_transformers(pair, n):
    kind, hf, gen = pair
    prompts = _prompts((7, 2), seed=3)
    eos = _eos_for(gen, prompts)
    _check(hf, gen, prompts, num_beams=4, no_repeat_ngram_size=n, max_new_tokens=16, eos_token_id=eos,
           num_return_sequences=2, min_new_tokens=4)


def test_beams_over_long_prompts_read_the_shared_blocks_once_per_sample(pair, monkeypatch):
    """Prompts of more than a block: decode steps fold the beams against the shared prompt blocks
    (engine/fastseq.py), with the same sequences and scores as transformers."""
    from fastdecode.engine import plan

    kind, hf, gen = pair
    folded = []
    original = plan.shared_prefix_attention
    monkeypatch.setattr(plan, "shared_prefix_attention",
                        lambda q, ks, *rest: folded.append(ks.shape[2]) or original(q, ks, *rest))
    prompts = _prompts((20, 37, 33), seed=4)
    _check(hf, gen, prompts, num_beams=3, max_new_tokens=8, eos_token_id=_eos_for(gen, prompts),
           num_return_sequences=2)
    if gen.model.device.type == "cuda":  # a GPU's decode steps replay the captured fixed-shape step (not folded)
        return
    assert folded and min(folded) == 16  # the one prompt block every sample holds in full


def test_beam_search_without_eos_runs_to_length(pair):
    kind, hf, gen = pair
    _check(hf, gen, _prompts((6, 9), seed=5), num_beams=3, max_new_tokens=8, num_return_sequences=3)


def test_shared_prompt_cache_does_not_grow_with_beams(pair):
    """A beam group's K beams are ``seq_keep`` forks of its prompt (engine/beam_group.py): they
    share the prompt's blocks by reference, nothing copied per beam; a beam's first write into
    the prompt's partial last block copies that one block (copy-on-write), the full blocks stay
    shared; the group reserves the prompt's blocks once and, per beam, its partial-block copy and
    its new tokens' blocks."""
    kind, hf, gen = pair
    prompts, new, size = _prompts((20, 13)), 10, 16
    blocks = lambda tokens: -(-tokens // size)  # noqa: E731
    for beams in (2, 4):
        engine = gen.engine(cuda_graphs=False)
        pool = engine.cache.pool
        roots = [engine.submit(p, {"num_beams": beams, "max_new_tokens": new, "min_new_tokens": new}) for p in prompts]
        engine.step()  # both prompts, then the first selection: each root forks into its beams
        for root, prompt in zip(roots, prompts):
            group = root.group
            tables = [beam.block_table for beam in group.beams]
            assert len(tables) == beams and all(list(t) == list(tables[0]) for t in tables)
            assert [pool.ref_counts[b] for b in tables[0]] == [beams] * blocks(len(prompt))  # shared, not copied
            assert group.bound == blocks(len(prompt)) + beams * (blocks(len(prompt) + new) - len(prompt) // size)
        written = {}  # first position written -> the tables as the step's forward writes them
        writable = engine.cache.writable
        engine.cache.writable = lambda table, start, end: written.setdefault(start, []).append(
            list(writable(table, start, end))) or table
        engine.step()  # each beam writes its first token into the prompt's partial block
        for prompt in prompts:
            tables, full = written[len(prompt)], len(prompt) // size
            assert len(tables) == beams and all(t[:full] == tables[0][:full] for t in tables)  # full blocks: once
            assert len({t[full] for t in tables}) == beams  # the partial block: one copy per beam
        del engine.cache.writable
        while engine.has_work():
            engine.step()
        assert pool.num_free == pool.num_blocks and all(len(root.group.results) == 1 for root in roots)


@pytest.mark.parametrize("early_stopping", [True, False])
def test_settled_samples_leave_the_batch_without_changing_results(pair, early_stopping, monkeypatch):
    """A sample whose finished set can no longer change is dropped (transformers keeps computing it)."""
    kind, hf, gen = pair
    ended = []  # the step at which each sample's beam group settled and left the engine
    finish = BeamGroup._finish
    monkeypatch.setattr(BeamGroup, "_finish", lambda self: (ended.append(self.scores.step), finish(self))[1])
    prompts = _prompts((5, 11, 3, 8, 2), seed=2)
    _check(hf, gen, prompts, num_beams=2, length_penalty=0.5, early_stopping=early_stopping, max_new_tokens=24,
           eos_token_id=_eos_for(gen, prompts))
    if kind not in ("llama-mqa", "mistral", "granite", "phi3-longrope"):  # with these prompts their samples all settle at the same step
        dropped = [step for step in ended if step < max(ended)]
        assert dropped, "no sample settled early: the test does not exercise dropping"
