"""Issue 10 (hardening): config and weight-shape validation, memory checks before allocation,
numeric option ranges, API types and invalid text, per-row seeding, chunked streaming prefill.
(The batch-file and std-stream cases run end to end through the CLI: tests/cli/test_hardening_cli.py.)"""

from __future__ import annotations


import numpy as np
import pytest
import torch

import fastdecode
from fastdecode.config import GenerationConfig, ModelConfig
from fastdecode.errors import CheckpointError, InvalidOptionError, InvalidPromptError, MemoryLimitError
from stream_alone import StreamAlone
from fastdecode.memory import check_request_memory, parse_size, request_parts
from fastdecode.models.registry import family_by_name
from tiny_encdec import build as build_encdec
from tiny_models import VOCAB, build, copy_folder

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return fastdecode.load(str(tiny_folder))


# -- case 11: config values and weight shapes ------------------------------------------------------
@pytest.mark.parametrize("changes, match", [
    ({"num_attention_heads": 0}, "num_heads must be an integer >= 1, got 0"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"num_attention_heads": 7}, r"num_kv_heads \(2\) must divide num_heads \(7\)"),
    ({"num_attention_heads": 7, "head_dim": None}, r"num_attention_heads \(7\) must divide hidden_size \(64\)"),
    ({"num_key_value_heads": 0}, "num_kv_heads must be an integer >= 1, got 0"),
    ({"num_key_value_heads": 5}, r"num_kv_heads \(5\) must divide num_heads \(4\)"),
    ({"hidden_size": "abc"}, "hidden_size must be an integer >= 1, got 'abc'"),
    ({"hidden_size": 576.5}, "hidden_size must be an integer >= 1, got 576.5"),
    ({"architectures": [["LlamaForCausalLM"]]}, "architectures must be a list of strings"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of strings"),
    ({"sliding_window": 0, "use_sliding_window": True}, "sliding_window must be an integer >= 1"),
    ({"num_hidden_layers": True}, "num_layers must be an integer >= 1, got True"),
])
def test_bad_config_values_are_checkpoint_errors(tiny_folder, tmp_path, changes, match):
    folder = copy_folder(tiny_folder, tmp_path / "bad", **changes)
    with pytest.raises(CheckpointError, match=match):
        fastdecode.load(str(folder))


def test_weights_that_do_not_fit_the_config_are_listed_with_both_shapes(tiny_folder, tmp_path):
    folder = copy_folder(tiny_folder, tmp_path / "wide", hidden_size=128)  # weights are 64 wide
    with pytest.raises(CheckpointError, match="whose shape does not match") as info:
        fastdecode.load(str(folder))
    message = str(info.value)
    assert "model.embed_tokens.weight (expected [160, 128], found [160, 64])" in message
    assert "model.layers.1.mlp.down_proj.weight (expected [128, 112], found [64, 112])" in message


def test_every_registered_family_declares_weight_shapes():
    from fastdecode.models.registry import FAMILIES

    assert [f.name for f in FAMILIES if not hasattr(f.load_module(), "weight_shapes")] == []


@pytest.mark.parametrize("kind, encdec", [("llama-mqa", False), ("gpt2", False), ("bloom", False), ("gemma3", False),
                                          ("bart", True), ("t5-gated", True), ("marian", True)])
def test_every_family_declares_the_shape_of_every_weight_it_loads(kind, encdec):
    """from_hf checks every shape on the way in; here: no loaded name lacks a declared shape."""
    from fastdecode.loading.names import template_indices

    gen = fastdecode.from_hf(build_encdec(kind) if encdec else build(kind))
    module = family_by_name(gen.config.family).load_module()
    declared = {template.format(**index) for template in module.weight_shapes(gen.config)
                for index in template_indices(template, gen.config.layer_counts)}
    required, optional = module.weight_names(gen.config)
    names = {t.format(**i) for t in required + optional for i in template_indices(t, gen.config.layer_counts)}
    assert names <= declared


# -- case 10: memory a request implies, before allocating -------------------------------------------
SMOLLM2 = ModelConfig(family="llama", architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192)


@pytest.mark.parametrize("options, culprit", [
    (dict(num_beams=100000, max_new_tokens=256), "num_beams (100000)"),
    (dict(n_ctx=100_000_000_000, max_new_tokens=None), "n_ctx (100000000000)"),
    (dict(num_return_sequences=1_000_000, do_sample=True), "num_return_sequences (1000000)"),
])
def test_request_too_large_names_the_option(options, culprit):
    config = GenerationConfig.from_options(max_memory="24GB", **options)
    assert sum(request_parts(SMOLLM2, config, [12], 4).values()) > 24e9
    with pytest.raises(MemoryLimitError, match=r"limit is 24\.0 GB \(max_memory\): lower " + culprit.replace("(", r"\(")
                       .replace(")", r"\)")):
        check_request_memory(SMOLLM2, config, [12], 4)
    modest = GenerationConfig.from_options(max_memory="24GB", max_new_tokens=256)
    assert check_request_memory(SMOLLM2, modest, [12], 4) < 1e9


def test_memory_is_checked_before_allocating_at_every_entry_point(tiny):
    with pytest.raises(MemoryLimitError, match="num_beams"):
        tiny.generate_ids([[5, 6]], num_beams=4, max_new_tokens=8, max_memory=2000)
    with pytest.raises(MemoryLimitError, match=r"n_ctx \(100000000000\)"):  # available memory by default
        tiny.generate_ids([[5, 6]], n_ctx=100_000_000_000, max_new_tokens=4)
    with pytest.raises(MemoryLimitError, match="n_ctx"):
        tiny.score([5, 6, 7], n_ctx=100_000_000_000)
    with pytest.raises(MemoryLimitError, match="n_ctx"):
        tiny.chat_session(n_ctx=100_000_000_000)
    with pytest.raises(InvalidOptionError, match="absurdly large"):
        tiny.generate_ids([[5, 6]], n_ctx=10**30)
    assert parse_size("512MiB") == 512 << 20 and parse_size(10) == 10
    for bad in ("lots", 0, -5, 1.5, True):
        with pytest.raises(InvalidOptionError, match="max_memory"):
            parse_size(bad)


# -- case 13: numeric options finite and in range ------------------------------------------------
@pytest.mark.parametrize("options, match", [
    (dict(seed=99999999999999999999999), "seed must be an integer in"),
    (dict(seed=-2), "seed must be an integer in"),  # -1: a random seed (OpenAI, issue 32)
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(num_beams=2, length_penalty=float("inf")), "length_penalty"),
    (dict(do_sample="no"), "do_sample must be True or False"),
    (dict(stop=123), "stop must be"),
    (dict(eos_token_id=10**30), "eos_token_id"),
    (dict(max_memory="lots"), "max_memory"),
])
def test_numeric_and_typed_options_are_checked(tiny, options, match):
    with pytest.raises(InvalidOptionError, match=match):
        tiny.generate("w5", max_new_tokens=2, **options)


# -- cases 12 and 15: API types and invalid text ------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda g: g.generate(None), "must be a string, got NoneType"),
    (lambda g: g.generate(123), "must be a string, got int"),
    (lambda g: g.generate(b"hello"), "must be text"),
    (lambda g: g.generate(["w5", 7]), "must be a string, got int"),
    (lambda g: g.generate("w5 \ud800"), "not valid Unicode"),
    (lambda g: g.generate([{"role": "user", "content": "w5 \udcff"}]), "not valid Unicode"),
    (lambda g: g.generate("w5", chat="yes"), "chat must be True or False"),
    (lambda g: g.score(None), "sequence of integers"),
    (lambda g: g.score(b"hello"), "must be text"),
    (lambda g: g.generate_ids([1, 2, 3]), "flat list"),
    (lambda g: g.generate_ids("w5"), "list of token-id sequences"),
    (lambda g: g.generate_ids([[1, 2.5]]), "must be integers"),
    (lambda g: g.generate_ids(torch.ones(2, 2, 2, dtype=torch.long)), "2-D tensor"),
    (lambda g: g.generate_ids([torch.tensor([1.0, 2.0])]), "must be integers"),
    (lambda g: list(g.stream_ids(None)), "sequence of integers"),
    (lambda g: g.chat_session(system=5), "must be a string"),
    (lambda g: fastdecode.load(123), "takes a path"),
])
def test_api_types_are_checked_at_the_boundary(tiny, call, match):
    with pytest.raises(InvalidOptionError, match=match):
        call(tiny)


def test_tensors_and_arrays_of_ids_are_accepted(tiny):
    expected = tiny.generate_ids([[5, 6, 7], [8, 9, 10]], max_new_tokens=3)
    assert tiny.generate_ids(torch.tensor([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3) == expected
    assert tiny.generate_ids(np.array([[5, 6, 7], [8, 9, 10]]), max_new_tokens=3) == expected
    assert tiny.generate_ids([np.array([5, 6, 7]), torch.tensor([8, 9, 10])], max_new_tokens=3) == expected
    assert list(tiny.stream_ids(torch.tensor([5, 6, 7]), max_new_tokens=3)) == expected[0]
    assert tiny.score(np.array([5, 6, 7])) == pytest.approx(tiny.score([5, 6, 7]))
    chat = tiny.chat_session(n_ctx=None)  # None means the default size
    assert chat.config.n_ctx == 256
    with pytest.raises(InvalidPromptError):
        list(chat.send("w5 \ud800"))
    assert isinstance("".join(chat.send("w5 w6")), str) and len(chat.messages) == 2  # still alive


# -- case 9: seeded sampling depends on the seed and the sequence only ------------------------------
def test_seeded_rows_do_not_depend_on_their_batch(tiny):
    options = dict(do_sample=True, temperature=1.5, max_new_tokens=8, seed=3)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    together = tiny.generate_ids(prompts, **options)
    assert together == [tiny.generate_ids([p], **options)[0] for p in prompts]
    per_prompt = tiny.generate_ids(prompts, **dict(options, seed=[1, 2, 3]))
    assert per_prompt[1] == tiny.generate_ids([prompts[1]], **dict(options, seed=2))[0]
    assert per_prompt != together
    with pytest.raises(InvalidOptionError, match="one per prompt"):
        tiny.generate_ids(prompts, **dict(options, seed=[1, 2]))


def test_inverse_cdf_draw_follows_the_distribution():
    from fastdecode.decoding.sampling import row_generators, sample_rows

    probs = torch.tensor([[0.0, 0.7, 0.0, 0.3]]).repeat(4000, 1)
    tokens = sample_rows(probs, row_generators(list(range(4000)), 4000, torch.device("cpu")))
    counts = torch.bincount(tokens, minlength=4)
    assert counts[0] == counts[2] == 0 and abs(counts[1].item() / 4000 - 0.7) < 0.03


# -- case 16: a long prompt through the shift policy is prefilled in chunks -------------------------
def test_long_prompt_is_chunked_through_the_shift_policy_with_the_same_logits():
    model = fastdecode.from_hf(build("llama-gqa")).model
    prompt = torch.randint(2, VOCAB, (300,), generator=torch.Generator().manual_seed(0))
    follow = torch.randint(2, VOCAB, (5,), generator=torch.Generator().manual_seed(1))
    chunked, reference = StreamAlone(model, 32, 4, 1), StreamAlone(model, 32, 4, 1)
    forwards = []
    original = model.forward
    with torch.inference_mode():
        model.forward = lambda tokens, *args: forwards.append(tokens.shape[1]) or original(tokens, *args)
        last = chunked.feed(prompt, prompt=False)
        model.forward = original
        one_by_one = [reference.feed(prompt[i:i + 1], prompt=False) for i in range(prompt.shape[0])][-1]
        assert len(forwards) < 20 and max(forwards) > 1  # chunks, not 300 single-token forwards
        torch.testing.assert_close(last, one_by_one, atol=1e-4, rtol=0)
        for token in follow:  # decoding after the chunked prompt equals decoding after one by one
            torch.testing.assert_close(chunked.feed(token[None], prompt=False),
                                       reference.feed(token[None], prompt=False), atol=1e-4, rtol=0)
        assert chunked._plan(1, prompt=False)._mask(None) is None  # decode stays unmasked
        assert chunked.cache.pool.num_free == 0 and chunked.end <= 32 + 32  # n_ctx + headroom, never more


@pytest.mark.slow
@pytest.mark.parametrize("options, culprit", [
    (dict(num_beams=100000), "num_beams (100000)"),
    (dict(n_ctx=100_000_000_000, max_new_tokens=None), "n_ctx (100000000000)"),
    (dict(num_return_sequences=1_000_000, do_sample=True), "num_return_sequences (1000000)"),
])
def test_the_issue_requests_fail_before_allocating_on_the_embedded_model(smollm, options, culprit):
    """The exact requests of the issue (terabytes each) against the memory available now."""
    with pytest.raises(MemoryLimitError, match=culprit.replace("(", r"\(").replace(")", r"\)")):
        smollm.generate("Hi", **{"max_new_tokens": 256, **options})
