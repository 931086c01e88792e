"""fastdecode vs transformers on tiny random encoder-decoder models (fp32): BART, mBART, Marian, T5 v1.0/v1.1."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from engine_helpers import OneSequence
from fastdecode.engine.cross import right_pad
from fastdecode.layers.products import Products
from tiny_encdec import ENCDEC_KINDS, VOCAB, build, hf_greedy, single_thread  # noqa: F401 (autouse fixture)

pytest.importorskip("transformers")

ATOL = 1e-4
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=ENCDEC_KINDS)
def pair(request, tmp_path_factory):
    """(kind, HF model, fastdecode Generator loaded from the saved safetensors folder)."""
    hf = build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, fastdecode.load(str(folder))


def _source(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB - 1, (length,), generator=generator, device="cpu").tolist()


def _start_token(hf) -> int:
    start = hf.generation_config.decoder_start_token_id
    return hf.generation_config.bos_token_id if start is None else start


def test_encoder_output_matches_transformers(pair):
    kind, hf, gen = pair
    sources = [_source(11, 1), _source(6, 2)]  # a right-padded batch: padding must not leak
    tokens, valid, positions = right_pad(sources, gen.device)
    with torch.no_grad():
        reference = hf.get_encoder()(input_ids=tokens, attention_mask=valid.long()).last_hidden_state
    with torch.inference_mode():
        ours = gen.model.encode(tokens, positions, valid, products=Products.generated(torch.get_num_threads(), kernels=gen.model.kernels))
    torch.testing.assert_close(ours[valid], reference[valid], atol=ATOL, rtol=0, msg=lambda m: f"{kind}: {m}")


def test_every_decoder_step_matches_transformers(pair):
    kind, hf, gen = pair
    source = _source(13, 3)
    continuation = hf_greedy(hf, [source], 20)[0]
    target = [_start_token(hf)] + continuation[:-1]  # what the decoder is fed
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([target])).logits[0]  # [T, V]

    one = OneSequence(gen, len(target), source=source)  # the engine's forward: decoder K/V and cross store
    step_logits = list(one.run(target[:1]))  # the start token: the decoder's prompt
    for token in continuation[:-1]:  # then one generated row per step, as a decode step runs it
        step_logits.append(one.run([token], prompt=False)[0])
    for step, logits in enumerate(step_logits):
        torch.testing.assert_close(logits, reference[step], atol=ATOL, rtol=0, msg=lambda m: f"{kind} step {step}: {m}")


def test_greedy_tokens_identical_to_transformers(pair):
    kind, hf, gen = pair
    for seed, length in ((4, 5), (5, 17)):
        source = _source(length, seed)
        ours = gen.generate_ids([source], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0]
        assert ours == hf_greedy(hf, [source], NEW_TOKENS)[0], kind


def test_padded_batch_equals_each_source_alone_and_transformers(pair):
    kind, hf, gen = pair
    sources = [_source(n, seed) for seed, n in ((6, 3), (7, 14), (8, 9), (9, 1))]
    batched = gen.generate_ids(sources, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    alone = [gen.generate_ids([s], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0] for s in sources]
    assert batched == alone, kind
    assert batched == hf_greedy(hf, sources, NEW_TOKENS), kind


def test_cached_equals_naive_recompute(pair):
    kind, hf, gen = pair
    sources = [_source(6, 10), _source(12, 11)]
    cached = gen.generate_ids(sources, max_new_tokens=NEW_TOKENS)
    naive = gen.generate_ids(sources, max_new_tokens=NEW_TOKENS, use_cache=False)
    assert cached == naive, kind


def test_from_hf_equals_load_of_saved_folder(pair):
    kind, hf, gen = pair
    wrapped = fastdecode.from_hf(hf)
    sources = [_source(9, 12), _source(4, 13)]
    assert wrapped.generate_ids(sources, max_new_tokens=16) == gen.generate_ids(sources, max_new_tokens=16)
    start = [_start_token(hf)]
    for source in sources:
        a = OneSequence(wrapped, 1, source=source).run(start)
        b = OneSequence(gen, 1, source=source).run(start)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    hf_pointers = {p.data_ptr() for p in hf.parameters()}
    assert wrapped.model.embed.data_ptr() in hf_pointers, kind  # shared, not copied


@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_forced_bos_and_eos_as_transformers_does(kind):
    """forced_bos_token_id forces the first target token, forced_eos_token_id the one at max length."""
    hf = build(kind, seed=3)
    hf.generation_config.forced_bos_token_id = 7
    hf.generation_config.forced_eos_token_id = hf.config.eos_token_id
    gen = fastdecode.from_hf(hf)
    sources = [_source(8, 14), _source(5, 15)]
    ours = gen.generate_ids(sources, max_new_tokens=10, min_new_tokens=10)
    assert ours == hf_greedy(hf, sources, 10)
    assert all(row[0] == 7 and row[-1] == hf.config.eos_token_id for row in ours)


def test_eos_stops_each_row_as_transformers_does():
    """With EOS live (no min length), rows finish at different steps and are dropped from the batch."""
    hf = build("bart", seed=1)
    gen = fastdecode.from_hf(hf)
    sources = [_source(n, 20 + n) for n in (4, 9, 13)]
    free = gen.generate_ids(sources, max_new_tokens=12, eos_token_id=[])  # no EOS: what each row produces
    eos = [free[0][2], free[1][6]]  # tokens the reference produces: rows must stop there
    ours = gen.generate_ids(sources, max_new_tokens=12, eos_token_id=eos)
    reference = hf_greedy(hf, sources, 12, min_new_tokens=0, eos_token_id=eos, pad_token_id=1)
    lengths = []
    for row, ref in zip(ours, reference):
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert row == ref[:cut]
        lengths.append(len(row))
    assert min(lengths) < 12  # at least one row really stopped early


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_repetition_penalty_sees_the_target_only_as_transformers_does(kind):
    """transformers penalizes tokens of the decoder input (start token + generated), not the source."""
    hf = build(kind, seed=4)
    gen = fastdecode.from_hf(hf)
    sources = [_source(7, 30), _source(12, 31)]
    ours = gen.generate_ids(sources, max_new_tokens=16, min_new_tokens=16, repetition_penalty=1.8)
    assert ours == hf_greedy(hf, sources, 16, repetition_penalty=1.8)


def test_seeded_sampling_is_reproducible():
    gen = fastdecode.from_hf(build("marian", seed=5))
    sources = [_source(6, 32), _source(10, 33)]
    options = dict(max_new_tokens=12, do_sample=True, temperature=0.9, top_k=40, seed=7, num_return_sequences=2)
    first = gen.generate_ids(sources, **options)
    assert len(first) == 4 and first == gen.generate_ids(sources, **options)
