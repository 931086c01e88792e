"""Streaming generation: shift equals its definition, re-evaluate equals its naive loop,
constant memory, and identical results before the cache is full."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.errors import InvalidOptionError
from stream_alone import StreamAlone
from fastdecode.layers.positions import (NoRotation, RotaryEmbedding, rope_inverse_frequencies, rotate_half_split,
                                         rotate_heads)
from fastdecode.layers.products import Products
from streaming_reference import ExplicitShiftEngine, logit_trace
from tiny_models import VOCAB, build, build_bloom

pytest.importorskip("transformers")
ATOL = 1e-4


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return fastdecode.from_hf(build("llama-gqa"))


@pytest.fixture(scope="module")
def llama_partial_rotary():
    """The same GQA llama with RoPE on half of each head's dims (as GPT-NeoX / Phi do)."""
    gen = fastdecode.from_hf(build("llama-gqa"))
    model = gen.model
    rotary_dim = model.config.head_dim // 2
    inv_freq, factor = rope_inverse_frequencies(rotary_dim, model.config.rope_theta, None, 256)
    model.rope = RotaryEmbedding(rotary_dim, inv_freq, factor)
    model.layer_ropes = [model.rope] * model.config.num_layers
    return gen


@pytest.fixture(scope="module")
def bloom():
    return fastdecode.from_hf(build_bloom())


# -- rotation algebra -------------------------------------------------------------------------------
SCALINGS = {  # every supported RoPE scaling type: scaled frequencies shift the same way
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotating_by_a_then_b_equals_rotating_by_a_plus_b(rotary_dim, scaling):
    """For every scaling type (YaRN's attention factor included: it scales the placed vector once,
    the shift is a pure rotation), moving a rotated vector by d places it at p + d."""
    inv_freq, factor = rope_inverse_frequencies(rotary_dim, 10000.0, SCALINGS[scaling], 256)
    assert scaling == "default" or not torch.equal(inv_freq, rope_inverse_frequencies(rotary_dim, 10000.0, None, 256)[0])
    rope = RotaryEmbedding(rotary_dim, inv_freq, factor)
    x = torch.randn(1, 2, 3, 16, dtype=torch.float64)
    torch.testing.assert_close(rope.rotate_by(rope.rotate_by(x, 37), -12), rope.rotate_by(x, 25))
    # rotating a vector placed at position p by d gives the vector placed at p + d
    positions = torch.tensor([[5, 900, 123456]])
    cos, sin = rope.cos_sin(positions, torch.float64)
    cos_d, sin_d = rope.cos_sin(positions + 40, torch.float64)
    torch.testing.assert_close(rope.rotate_by(rotate_half_split(x, cos, sin), 40), rotate_half_split(x, cos_d, sin_d))


def test_a_layer_without_rope_rotates_by_the_identity_exactly():
    """SmolLM3's NoPE layers run the rotation with cos 1, sin 0 (bit-exact identity) and shift by nothing."""
    rope = NoRotation(16)
    x = torch.randn(2, 5, 3, 16)
    cos, signed_sin = rope.tables(torch.arange(5).repeat(2, 1) * 1000, x.dtype)  # [B, T, 1, D]
    assert torch.equal(rotate_heads(x, cos, signed_sin), x)
    assert torch.equal(rope.rotate_by(x, 17), x)


def test_angles_are_exact_at_huge_positions():
    """Positions in a stream grow without bound: angles are computed in float64 before the cast."""
    inv_freq, _ = rope_inverse_frequencies(16, 10000.0, None, 256)
    rope = RotaryEmbedding(16, inv_freq)
    cos, _ = rope.cos_sin(torch.tensor([[10_000_000]]), torch.float32)
    exact = torch.cos(torch.tensor(10_000_000, dtype=torch.float64) * inv_freq.double())
    torch.testing.assert_close(cos[0, 0, 0, :8].double(), exact, atol=1e-6, rtol=0)


# -- shift equals its definition ---------------------------------------------------------------------
@pytest.mark.parametrize("model_name", ["llama", "llama_partial_rotary", "bloom"])
@pytest.mark.parametrize("n_keep, n_discard", [(4, 1), (4, 5), (0, 3)])
def test_shift_equals_explicit_key_rotation(model_name, n_keep, n_discard, request):
    gen = request.getfixturevalue(model_name)
    tokens = _tokens(70, seed=1)
    ours = logit_trace(StreamAlone(gen.model, 24, n_keep, n_discard), tokens)
    reference = logit_trace(ExplicitShiftEngine(gen.model, 24, n_keep, n_discard), tokens)
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)


@pytest.mark.parametrize("model_name", ["llama", "bloom"])
@pytest.mark.parametrize("n_discard, headroom", [(7, 5), (7, 20), (1, 3), (1, 32)])
def test_shift_chunked_feed_equals_token_by_token(model_name, n_discard, headroom, request):
    """Chunks of ``headroom`` tokens (drops inside a chunk, compactions between chunks) equal one
    token at a time."""
    model = request.getfixturevalue(model_name).model
    tokens = _tokens(90, seed=2)
    engine = StreamAlone(model, 32, 4, n_discard, headroom=headroom)
    with torch.inference_mode():
        chunks = list(engine.feed_chunks(tokens, all_logits=True, prompt=False))
    assert chunks[0].shape[0] == 32 + headroom  # a fresh stream takes n_ctx + headroom at once
    assert max(c.shape[0] for c in chunks[1:]) <= headroom and engine.compacted > 0
    one_by_one = logit_trace(StreamAlone(model, 32, 4, n_discard), tokens)
    torch.testing.assert_close(torch.cat(chunks), one_by_one, atol=ATOL, rtol=0)


def test_a_ring_of_one_moves_only_the_sinks(llama):
    """n_discard=1 on a full cache: the sinks move one position up over the dropped token
    (seq_add on n_keep keys), the new token takes one slot, no window key is rewritten and the
    decode step needs no mask; once the headroom is used up, one compaction moves everything back."""
    engine = StreamAlone(llama.model, 16, 4, 1, headroom=8)
    with torch.inference_mode():
        engine.feed(_tokens(17, 3), prompt=False)
        before = engine.cache.keys.clone()
        engine.feed(_tokens(1, 4), prompt=False)
        changed = (engine.cache.keys != before).flatten(2).any(dim=-1).any(dim=0)  # [slots] written
        assert changed.sum().item() == 4 + 1 and engine.shift == 2 and engine.sink_start == 2
        plan = engine._plan(1, prompt=False)
        assert plan._mask(None) is None and plan.slot_range is not None  # one view, no mask, no gather
        engine.feed(_tokens(10, 5), prompt=False)
    assert engine.compacted > 0 and engine.end <= 16 + 8 and engine.cache.pool.num_free == 0


def test_learned_positions_cannot_shift():
    gpt2 = fastdecode.from_hf(build("gpt2"))
    with pytest.raises(InvalidOptionError, match="reevaluate"):
        gpt2.generate_ids([[3, 4, 5]], max_new_tokens=4, n_ctx=16, policy="shift")


# -- before the cache is full -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["shift", "reevaluate"])
def test_streaming_equals_plain_generation_within_the_context(llama, bloom, policy):
    for gen in (llama, bloom):
        prompt = _tokens(9, 5).tolist()
        plain = gen.generate_ids([prompt], max_new_tokens=30)
        assert gen.generate_ids([prompt], max_new_tokens=30, n_ctx=64, policy=policy) == plain


# -- re-evaluate equals its naive loop ---------------------------------------------------------------
def _naive_reevaluate(model, prompt, new_tokens, n_ctx, n_keep, n_discard):
    """At the moment the cache is full, drop tokens and re-run the model on what is kept."""
    context, out = [], []

    def add(token):
        nonlocal context
        if len(context) == n_ctx:
            context = context[:n_keep] + context[n_keep + n_discard :]
        context.append(token)

    for token in prompt:
        add(token)
    for _ in range(new_tokens):
        ids = torch.tensor([context])
        with torch.inference_mode():
            positions = torch.arange(len(context))[None]  # [1, T]
            naive = fastdecode.cache.view.NoCache.of_model(
                model, Products.generated(torch.get_num_threads(), kernels=model.kernels), _causal(len(context)), positions)
            logits = model.forward(ids, positions, naive)[0, -1]
        token = int(logits.argmax())
        out.append(token)
        add(token)
    return out


def _causal(n):
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


@pytest.mark.parametrize("kind", ["llama-gqa", "gpt2"])
def test_reevaluate_equals_naive_loop(kind):
    import fastdecode.cache.view  # noqa: F401  (for NoCache above)

    gen = fastdecode.from_hf(build(kind))
    prompt = _tokens(10, 6).tolist()
    ours = gen.generate_ids([prompt], max_new_tokens=60, n_ctx=24, n_keep=4, n_discard=6, policy="reevaluate")[0]
    assert ours == _naive_reevaluate(gen.model, prompt, 60, 24, 4, 6)


def test_reevaluate_long_prompt_goes_through_the_policy(llama):
    prompt = _tokens(50, 7).tolist()
    engine = StreamAlone(llama.model, 16, 2, 4, policy="reevaluate")
    with torch.inference_mode():
        engine.feed(torch.tensor(prompt), prompt=False)
    assert engine.rebuilds > 0 and len(engine.tokens) == engine.end <= 16
    assert llama.generate_ids([prompt], max_new_tokens=5, n_ctx=16, n_keep=2, n_discard=4, policy="reevaluate")[0] \
        == _naive_reevaluate(llama.model, prompt, 5, 16, 2, 4)


# -- constant memory, endless generation -------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096


@pytest.mark.parametrize("policy", ["shift", "reevaluate"])
def test_memory_stays_constant_over_5000_tokens(llama, policy):
    stream = llama.stream_ids([5, 6, 7], max_new_tokens=None, n_ctx=256, n_keep=4, policy=policy,
                              do_sample=True, seed=0)
    rss = {}
    for count, _ in enumerate(stream, start=1):
        if count in (1000, 5000):
            rss[count] = _rss_bytes()
        if count == 5000:
            break
    stream.close()
    assert rss[5000] - rss[1000] < 8 * 2**20  # the cache is 2 x 2 x 256 x 2 x 16 floats; nothing grows


def test_endless_needs_a_streaming_cache(llama):
    with pytest.raises(InvalidOptionError, match="n_ctx"):
        llama.generate_ids([[3]], max_new_tokens=None)


@pytest.mark.parametrize("options, pattern", [
    ({"n_ctx": 8, "n_keep": 8}, "n_keep"),
    ({"n_ctx": 16, "n_discard": 20}, "n_discard"),
    ({"n_ctx": 16, "policy": "rotate"}, "policy"),
    ({"n_ctx": 1}, "n_ctx"),
])
def test_bad_streaming_options(llama, options, pattern):
    with pytest.raises(InvalidOptionError, match=pattern):
        llama.generate_ids([[3, 4]], max_new_tokens=4, **options)


def test_streaming_score_equals_plain_score_within_the_context(llama):
    ids = _tokens(40, 8).tolist()
    plain = llama.score(ids)
    for policy in ("shift", "reevaluate"):
        torch.testing.assert_close(torch.tensor(llama.score(ids, n_ctx=64, policy=policy)), torch.tensor(plain),
                                   atol=ATOL, rtol=0)


def test_prompt_longer_than_the_model_context_streams(llama):
    long_prompt = _tokens(300, 9).tolist()  # the tiny model's context is 256
    out = llama.generate_ids([long_prompt], max_new_tokens=8, n_ctx=64)
    assert len(out[0]) == 8


def test_chat_turns_feed_only_their_new_tokens(tmp_path):
    """The second turn feeds the rendering's new suffix (and the pending last reply token), not the whole
    conversation again."""
    from tiny_models import save_tiny_folder

    save_tiny_folder(tmp_path, "llama-gqa")
    gen = fastdecode.load(str(tmp_path))
    session = gen.chat_session(n_ctx=128, max_new_tokens=5)
    "".join(session.send("w1 w2 w3"))
    fed_after_first = session.engine.next_position
    "".join(session.send("w4 w5"))
    fed_in_second = session.engine.next_position - fed_after_first
    whole = gen.tokenizer.encode(gen.tokenizer.apply_chat_template(session.messages[:-1]), add_special_tokens=False)
    assert session.full_rebuilds == 0
    assert fed_in_second < len(whole)  # the first turn was not prefilled again
    assert session.engine.next_position == len(whole) + len(gen.tokenizer.encode(session.messages[-1]["content"],
                                                                                   add_special_tokens=False)) - 1


@pytest.mark.parametrize("kind", ["llama-gqa", "gemma3"])
def test_sinks_move_like_seq_add(kind):
    """The per-token sink move (every layer at once, per RoPE table) equals the slot cache's verb
    ``seq_add`` with the K-shift, layer by layer (Gemma 3: two rotary tables)."""
    model = fastdecode.from_hf(build(kind)).model
    moved, verb = StreamAlone(model, 16, 4, 1, headroom=8), StreamAlone(model, 16, 4, 1, headroom=8)
    with torch.inference_mode():
        for engine in (moved, verb):
            engine.feed(_tokens(16, 10), prompt=False)
        moved._move_sinks(3)
        verb.table = verb.cache.seq_add(verb.table, 0, 4, 3, verb._rotate)
    torch.testing.assert_close(moved.cache.keys, verb.cache.keys, atol=1e-6, rtol=0)
    assert torch.equal(moved.cache.values, verb.cache.values)
