"""Encoder-decoder beam search vs transformers on tiny BART, Marian and T5 (fp32): same sequences, same
scores; the sources' cross K/V once per sample, the decoder's K/V in the slot cache per beam."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine.beam_group import BeamGroup
from fastdecode.generation.encdec import start_beam_encoder_decoder
from fastdecode.config import GenerationConfig
from tiny_encdec import VOCAB, build, hf_greedy, single_thread  # noqa: F401 (autouse fixture)

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["bart", "marian", "t5"])
def pair(request, tmp_path_factory):
    hf = build(request.param)
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)  # sharper distributions: EOS candidates compete with long beams
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, fastdecode.load(str(folder))


def _sources(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB - 1, (n,), generator=generator, device="cpu").tolist() for n in lengths]


def _hf_beam(hf, sources, **options):
    pad = hf.config.pad_token_id
    length = max(len(s) for s in sources)
    ids = torch.tensor([s + [pad] * (length - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (length - len(s)) for s in sources])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, do_sample=False, output_scores=True,
                          return_dict_in_generate=True, **options)
    return out.sequences[:, 1:].tolist(), out.sequences_scores  # without the decoder start token


def _check(hf, gen, sources, **options):
    theirs, their_scores = _hf_beam(hf, sources, **options)
    ours = gen.generate_ids_with_details(sources, **options)
    eos = options["eos_token_id"]
    fill = hf.config.pad_token_id or eos  # what transformers pads finished beams with
    assert len(ours) == len(theirs)
    for mine, ref in zip(ours, theirs):
        assert mine.tokens + [fill] * (len(ref) - len(mine.tokens)) == ref, options
    torch.testing.assert_close(torch.tensor([r.score for r in ours]), their_scores.float(), atol=1e-4, rtol=0)
    return ours


def _eos_for(gen, sources):
    return gen.generate_ids([sources[0]], max_new_tokens=5, min_new_tokens=5)[0][4]


@pytest.mark.parametrize("beams, length_penalty, early_stopping, ngram", [
    (2, 1.0, False, 0), (4, 2.0, True, 0), (4, 0.5, "never", 0), (4, 1.0, False, 3), (4, 2.0, True, 2),
])
def test_encdec_beam_search_matches_transformers(pair, beams, length_penalty, early_stopping, ngram):
    kind, hf, gen = pair
    sources = _sources((9, 4, 13))
    _check(hf, gen, sources, num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
           no_repeat_ngram_size=ngram, max_new_tokens=14, eos_token_id=_eos_for(gen, sources),
           num_return_sequences=2)


def test_batched_sources_of_different_lengths_equal_each_alone(pair):
    kind, hf, gen = pair
    sources = _sources((9, 4, 13), seed=3)
    options = dict(num_beams=3, no_repeat_ngram_size=2, max_new_tokens=10, eos_token_id=_eos_for(gen, sources),
                   num_return_sequences=2)
    batched = gen.generate_ids_with_details(sources, **options)
    alone = [r for source in sources for r in gen.generate_ids_with_details([source], **options)]
    assert [r.tokens for r in batched] == [r.tokens for r in alone], kind
    torch.testing.assert_close(torch.tensor([r.score for r in batched]), torch.tensor([r.score for r in alone]),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("n", [1, 2])
def test_encoder_no_repeat_ngram_matches_transformers(pair, n):
    kind, hf, gen = pair
    sources = _sources((10, 10), seed=4)  # same length: transformers counts source padding as tokens
    _check(hf, gen, sources, num_beams=3, encoder_no_repeat_ngram_size=n, max_new_tokens=10,
           eos_token_id=_eos_for(gen, sources), num_return_sequences=2)
    greedy = gen.generate_ids(sources, encoder_no_repeat_ngram_size=n, max_new_tokens=10, min_new_tokens=10)
    assert greedy == hf_greedy(hf, sources, 10, encoder_no_repeat_ngram_size=n)


def test_cross_attention_kv_stay_once_per_source(pair):
    """The sources' cross K/V are stored once per sample whatever the beam count; the decoder's
    self-attention blocks grow per beam, and a beam reorder moves blocks, never cross K/V."""
    kind, hf, gen = pair
    cfg = gen.config
    sources = _sources((9, 4))
    sizes = {}
    for beams in (1, 2, 4):
        config = GenerationConfig(num_beams=beams, max_new_tokens=6)
        with torch.inference_mode():
            engine = start_beam_encoder_decoder(gen.model, sources, config).engine
            cross = engine.sources
            assert cross.keys[0].shape == (2, cfg.num_heads, 9, cfg.head_dim)  # [B, H, S_src, D]: per source
            assert cross.nbytes == 2 * 9 * cfg.cross_cache_bytes_per_source_token(4)
            # the start token: one block per sample, shared by reference by its beams
            assert [engine.cache.pool.ref_counts[table[0]] for table in engine.tables] == [beams] * 2 * beams
            pointers = [k.data_ptr() for k in cross.keys]
            engine.decode(torch.arange(2 * beams) + 3, torch.ones(2 * beams, dtype=torch.long))
            engine.reorder_beams(torch.arange(2 * beams).view(2, beams)[:, :1].repeat(1, beams).flatten())
            assert [k.data_ptr() for k in engine.sources.keys] == pointers  # nothing moved or copied
        sizes[beams] = (cross.nbytes, engine.shared_nbytes, engine.per_beam_nbytes)
    assert sizes[1][:2] == sizes[2][:2] == sizes[4][:2]  # once per sample
    assert sizes[4][2] == 2 * sizes[2][2] == 4 * sizes[1][2]  # decoder self-attention: per beam


def test_settled_sources_leave_the_batch_without_changing_results(pair, monkeypatch):
    kind, hf, gen = pair
    ended = []  # the step at which each source's beam group settled and left the engine
    finish = BeamGroup._finish
    monkeypatch.setattr(BeamGroup, "_finish", lambda self: (ended.append(self.scores.step), finish(self))[1])
    sources = _sources((9, 4, 13, 6, 7), seed=2)
    _check(hf, gen, sources, num_beams=2, early_stopping=True, max_new_tokens=16, eos_token_id=2)
    dropped = [step for step in ended if step < max(ended)]
    if kind == "bart":  # with this seed only BART's sources settle at different steps
        assert dropped
