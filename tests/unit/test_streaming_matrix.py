"""Streaming on every attention kind, with every strategy it allows: greedy past n_ctx equals the
explicit definition (shift) or the naive loop (re-evaluate), batched prompts equal each prompt
alone (greedy and seeded sampling), on float and on quantized weights, and refusals are typed
(learned positions cannot shift, beam search cannot stream)."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.errors import InvalidOptionError
from streaming_reference import ExplicitShiftEngine
from tiny_models import VOCAB, build

pytest.importorskip("transformers")
# llama-gqa: test_streaming.py. Every RoPE variant shifts: llama3 and YaRN scaled frequencies, SmolLM3's
# NoPE layers (no rotation to shift) between scaled ones, Qwen3's normed keys, Granite, OLMo 2.
SHIFTABLE = ["llama-mha", "llama-mqa", "mistral", "qwen2-swa", "gemma3", "bloom", "llama-rope-llama3",
             "llama-rope-yarn", "qwen3-tied-mqa", "granite", "smollm3-nope-list", "olmo2",
             "phi3-longrope", "phi3-swa", "gemma2"]
STREAM = {"n_ctx": 20, "n_keep": 3}


@pytest.fixture(scope="module", params=SHIFTABLE + ["gpt2"])
def kind_gen(request):
    return request.param, fastdecode.from_hf(build(request.param))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _explicit_greedy(model, prompt: list[int], new_tokens: int, n_discard: int) -> list[int]:
    engine = ExplicitShiftEngine(model, STREAM["n_ctx"], STREAM["n_keep"], n_discard)
    out = []
    with torch.inference_mode():
        logits = engine.feed(torch.tensor(prompt))
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = engine.feed(torch.tensor(out[-1:]))
    return out


@pytest.mark.parametrize("n_discard", [1, 4])
def test_shift_greedy_past_the_context_equals_the_definition(kind_gen, n_discard):
    kind, gen = kind_gen
    prompt = _prompt(30, 1)  # longer than n_ctx: the prompt itself goes through the policy
    if kind == "gpt2":
        with pytest.raises(InvalidOptionError, match="learned absolute positions"):
            gen.generate_ids([prompt], max_new_tokens=4, policy="shift", n_discard=n_discard, **STREAM)
        return
    ours = gen.generate_ids([prompt], max_new_tokens=16, policy="shift", n_discard=n_discard, **STREAM)[0]
    assert ours == _explicit_greedy(gen.model, prompt, 16, n_discard)


@pytest.mark.parametrize("policy", ["shift", "reevaluate"])
@pytest.mark.parametrize("sampling", [{}, {"do_sample": True, "top_k": 20, "seed": 7}], ids=["greedy", "sampling"])
def test_batched_prompts_equal_each_alone(kind_gen, policy, sampling):
    kind, gen = kind_gen
    if kind == "gpt2" and policy == "shift":
        pytest.skip("learned positions cannot shift (refusal tested above)")
    prompts = [_prompt(22, 2), _prompt(6, 3)]  # past n_ctx, and crossing it while generating
    options = {"max_new_tokens": 16, "policy": policy, **STREAM, **sampling}
    together = gen.generate_ids(prompts, **options)
    assert together == [gen.generate_ids([p], **options)[0] for p in prompts]
    assert all(len(tokens) == 16 for tokens in together)


def test_beam_search_cannot_stream(kind_gen):
    _, gen = kind_gen
    with pytest.raises(InvalidOptionError, match="streaming cache"):
        gen.generate_ids([[3, 4, 5]], max_new_tokens=4, num_beams=2, **STREAM)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama-mqa", "qwen2-swa", "gemma3", "bloom", "gpt2", "qwen3-tied-mqa", "smollm3-nope-list",
                                  "olmo2", "gemma2",
                                  "phi3-longrope"])
def test_quantized_weights_stream_batched_as_each_alone(kind, quantize):
    """Quantized weights (prompt rows exact, generated rows the int8 kernel) through both policies: a prompt
    past n_ctx and one crossing it while generating, batched, give each prompt's tokens alone. (Exact prompt
    rows: batched, a prompt may be read in other chunks than alone, whose attention sums differ in the last
    bit; the default's int8 rounding of the MLP's prompt rows can turn that into another token at a near
    tie: found on gemma2, int8, shift, sampling.)"""
    gen = fastdecode.from_hf(build(kind), quantize=quantize, prompt_rows="exact")
    prompts = [_prompt(22, 4), _prompt(6, 5)]
    for policy in ["reevaluate"] + (["shift"] if kind != "gpt2" else []):
        for sampling in [{}, {"do_sample": True, "top_k": 20, "seed": 3}]:
            options = {"max_new_tokens": 16, "policy": policy, **STREAM, **sampling}
            together = gen.generate_ids(prompts, **options)
            assert together == [gen.generate_ids([p], **options)[0] for p in prompts]
            assert all(len(tokens) == 16 for tokens in together)
