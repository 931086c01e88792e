"""fastdecode on a CUDA GPU: the captured decode step, host syncs, half precision against transformers.

Skipped without a GPU (CI has none). The float32 parity suite runs on the GPU with
``pytest tests/parity --device cuda``; these tests cover what only a GPU has.
"""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine.decode_step import decode_products, decode_step, decode_window_tables
from tiny_models import VOCAB, build, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

CUDA = torch.device("cuda")


def _prompts(lengths, seed=0, vocab=VOCAB):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=generator, device="cpu").tolist() for n in lengths]


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2-swa", "gemma3", "gpt2", "bloom"])
def cuda_pair(request):
    kind = request.param
    hf = build(kind).to(CUDA).eval()
    return kind, hf, fastdecode.from_hf(hf)


def _engine_outputs(gen, prompts, cuda_graphs, **options):
    engine = gen.engine(cuda_graphs=cuda_graphs)
    sequences = [engine.submit(p, dict(options, logprobs=0)) for p in prompts]
    logprobs = {s.id: [] for s in sequences}
    while engine.has_work():
        for event in engine.step():
            if event.logprob is not None:
                logprobs[event.sequence.id].append(event.logprob)
    return [s.output_ids for s in sequences], [logprobs[s.id] for s in sequences], engine


def test_captured_engine_gives_transformers_greedy_tokens(cuda_pair):
    kind, hf, gen = cuda_pair
    prompts = _prompts((5, 17, 9), seed=1)
    tokens, _, engine = _engine_outputs(gen, prompts, cuda_graphs=True, max_new_tokens=24)
    assert engine.compiled is not None and engine.compiled.replays > 0, "no step ran from a graph"
    for prompt, ours in zip(prompts, tokens):
        assert ours == hf_greedy(hf, prompt, 24), kind


def test_captured_steps_equal_eager_steps(cuda_pair):
    kind, _, gen = cuda_pair
    prompts = _prompts((3, 30, 12, 7, 21), seed=2)
    graphed, graphed_lp, _ = _engine_outputs(gen, prompts, cuda_graphs=True, max_new_tokens=40)
    eager, eager_lp, engine = _engine_outputs(gen, prompts, cuda_graphs=False, max_new_tokens=40)
    assert engine.compiled is None
    assert graphed == eager, kind
    for a, b in zip(graphed_lp, eager_lp):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_replay_is_bitwise_the_eager_decode_step_and_never_syncs(cuda_pair):
    """The graph replays exactly the kernels of the eager fixed-shape step; neither asks the host."""
    kind, _, gen = cuda_pair
    engine = gen.engine(cuda_graphs=True)
    sequences = [engine.submit(p, {"max_new_tokens": 8}) for p in _prompts((4, 19, 33), seed=3)]
    while any(s.num_computed < len(s.prompt_ids) for s in sequences):
        engine.step()  # prompts read and one token sampled each: the next step is a pure decode
    captured = engine.compiled
    rows, blocks = 4, captured.table_width(sequences)
    table, tokens, positions, windowed = captured.inputs(sequences, rows, blocks)
    static = (table.to(CUDA), tokens.to(CUDA), positions.to(CUDA), tuple((t.to(CUDA), s.to(CUDA)) for t, s in windowed))
    with torch.inference_mode():
        first = captured.logits(sequences).clone()  # captures this bucket (capturing synchronizes), replays it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            eager, _ = decode_step(gen.model, engine.cache, engine.windows, engine.score_bias,
                                   decode_products(gen.model), *static)
            graphed = captured.logits(sequences)  # a replay of the captured graph
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, eager[:3]), kind
    assert torch.equal(graphed, eager[:3]), kind


SYNC_FREE_OPTIONS = {
    "greedy": {},
    "repetition penalty": {"repetition_penalty": 1.3},
    "no-repeat n-gram": {"no_repeat_ngram_size": 3},
    "min new tokens": {"min_new_tokens": 3},
    "temperature": {"do_sample": True, "temperature": 0.7, "seed": 0},
    "top-k": {"do_sample": True, "top_k": 20, "seed": 0},
    "top-p": {"do_sample": True, "top_p": 0.9, "seed": 0},
}


@pytest.mark.parametrize("name", list(SYNC_FREE_OPTIONS))
def test_processors_and_sampling_never_sync(name):
    """Each per-step processor and the draw run on the device: the engine reads tokens back once per step."""
    from fastdecode.config import GenerationConfig
    from fastdecode.decoding.sampling import TokenSelector

    config = GenerationConfig.from_options(GenerationConfig(), **SYNC_FREE_OPTIONS[name])
    selector = TokenSelector(config, [1], 50, CUDA)
    selector.start([[3, 4, 5, 3, 4], [7, 8]], CUDA)
    logits = torch.randn(2, 50, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(4):
            tokens = selector.select(logits, step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == (2,) and tokens.is_cuda


def test_no_repeat_ngram_beams_on_cuda_match_transformers():
    hf = build("llama-gqa").to(CUDA).eval()
    gen = fastdecode.from_hf(hf)
    prompts = _prompts((6, 11), seed=4)
    ours = gen.generate_ids(prompts, max_new_tokens=20, num_beams=4, no_repeat_ngram_size=2)
    for prompt, result in zip(prompts, ours):
        expected = hf.generate(torch.tensor([prompt], device=CUDA), max_new_tokens=20, num_beams=4,
                               no_repeat_ngram_size=2, do_sample=False, pad_token_id=0, eos_token_id=None,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=CUDA))
        assert result == expected[0, len(prompt):].tolist()


# -- half precision ---------------------------------------------------------------------------------

NEAR_TIE = 0.25  # float32 top-2 logit gap under which half-precision rounding may pick either token


def _half_model(kind, dtype):
    """A small random model (a Llama of 4 layers and 512 words, or the tiny Gemma 3) in ``dtype`` on the GPU."""
    if kind == "gemma3":
        return build(kind).to(device=CUDA, dtype=dtype).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.08, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval().to(device=CUDA, dtype=dtype)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_greedy_agrees_with_transformers(kind, dtype):
    """fastdecode in half precision against transformers' own half-precision model on the same weights:
    - teacher-forced over transformers' greedy continuations, the argmax agrees at >= 95% of positions,
      and every disagreement is at a near tie of the float32 model (top-2 gap < NEAR_TIE) or one where
      fastdecode keeps the float32 model's choice;
    - free-running greedy, each prompt's tokens equal transformers' up to a step where the float32
      model's top-2 logits (after the common prefix) are a near tie, or where transformers' generate
      leaves the float32 model's choice and fastdecode keeps it;
    - the logits' error against float32 is of the order of transformers' own."""
    hf, exact = _half_model(kind, dtype), _half_model(kind, torch.float32)
    vocab = hf.config.vocab_size
    gen = fastdecode.from_hf(hf)
    prompts = _prompts((8, 16, 24, 5, 12, 30, 9, 20), seed=5, vocab=vocab)
    new = 24
    ours = gen.generate_ids(prompts, max_new_tokens=new)
    agreed = total = prefix = 0
    worst_ours = worst_theirs = 0.0
    for prompt, tokens in zip(prompts, ours):
        theirs = hf_greedy(hf, prompt, new)
        full = torch.tensor([prompt + theirs], device=CUDA)
        with torch.no_grad():
            reference = exact(full).logits[0]  # [T, V] float32
            their_logits = hf(full).logits[0].float()
        mine = _prefill_logits(gen, prompt + theirs).float()  # [T, V]
        span = slice(len(prompt) - 1, len(prompt) + new - 1)  # the positions that chose a new token
        top2 = reference[span].topk(2).values
        near_tie = (top2[:, 0] - top2[:, 1]) < NEAR_TIE
        exact_choice = reference[span].argmax(-1)
        differ = mine[span].argmax(-1) != their_logits[span].argmax(-1)
        ours_exact = mine[span].argmax(-1) == exact_choice  # where transformers' rounding is the one that moved
        assert not (differ & ~near_tie & ~ours_exact).any(), f"{kind} {dtype}: a disagreement away from a near tie"
        agreed += int((~differ).sum())
        total += new
        worst_ours = max(worst_ours, (mine - reference).abs().max().item())
        worst_theirs = max(worst_theirs, (their_logits - reference).abs().max().item())
        first = next((i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b), None)
        prefix += new if first is None else first
        if first is not None:  # the first free-running difference: a near tie of the exact model, or
            with torch.no_grad():  # transformers' generate leaving the exact model's choice that ours keeps
                logits = exact(torch.tensor([prompt + theirs[:first]], device=CUDA)).logits[0, -1]
            gap = logits.topk(2).values
            assert gap[0] - gap[1] < NEAR_TIE or tokens[first] == int(logits.argmax()), \
                f"{kind} {dtype}: diverged at step {first} away from a near tie"
    print(f"{kind} {dtype}: teacher-forced agreement {agreed / total:.1%}, free-running prefix agreement "
          f"{prefix / total:.1%}; max |logit - float32|: fastdecode {worst_ours:.4f}, transformers {worst_theirs:.4f}")
    assert agreed / total >= 0.95
    assert worst_ours <= 2 * worst_theirs + 1e-3


def _prefill_logits(gen, ids):
    from tiny_models import prefill_logits

    return prefill_logits(gen, ids)  # [T, V]


def test_load_folder_in_bfloat16_on_cuda(tmp_path):
    hf = build("llama-gqa").eval()
    hf.save_pretrained(tmp_path)
    gen = fastdecode.load(str(tmp_path), device="cuda", dtype="bfloat16")
    assert gen.model.dtype == torch.bfloat16 and gen.device.type == "cuda"
    out = gen.generate_ids(_prompts((7,), seed=6), max_new_tokens=12)[0]
    assert len(out) == 12 and all(0 <= t < VOCAB for t in out)


def test_soft_capped_gemma2_logits_are_the_cpu_logits():
    """Gemma 2 (attention and final logits soft-capped, sliding layers) on the GPU in float32: the
    same prefill logits as fastdecode's on the CPU, and as transformers' eager attention (the one
    implementation of it that applies the soft caps) on the GPU. Found on an H200 with transformers
    5.17: the parity suite's Gemma 2 tests alone differed from transformers by up to 0.66."""
    from tiny_models import prefill_logits

    ids = _prompts((20,), seed=7)[0]
    hf = build("gemma2")
    on_cpu = prefill_logits(fastdecode.from_hf(hf), ids)  # [T, V]
    hf = hf.to(CUDA)
    on_gpu = prefill_logits(fastdecode.from_hf(hf), ids).cpu()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        eager = hf(torch.tensor([ids], device=CUDA)).logits[0].float().cpu()
    torch.testing.assert_close(on_gpu, on_cpu, atol=1e-4, rtol=0)
    torch.testing.assert_close(on_gpu, eager, atol=1e-4, rtol=0)
