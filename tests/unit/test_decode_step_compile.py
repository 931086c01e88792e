"""The decode step is capturable: torch.compile(fullgraph=True, dynamic=False) traces it once per
batch-size bucket, with no graph break (no host sync), and its logits equal the eager step's."""

from __future__ import annotations

import functools

import pytest
import torch

import fastdecode
from fastdecode.engine.decode_step import decode_products, decode_step, decode_window_tables
from tiny_models import VOCAB, build

pytest.importorskip("transformers")
STEPS = 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-gqa", "mistral", "bloom"])
def test_compiled_decode_step_one_graph_per_bucket_equal_logits(kind):
    gen = fastdecode.from_hf(build(kind))
    engine = gen.engine(cache_tokens=512)
    prompts = [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 11, 3, 8)]
    sequences = [engine.submit(p, {"max_new_tokens": 40}) for p in prompts]
    engine.step()  # every prompt read, one token each: the rest is decoding
    cache = engine.cache
    buffers = [cache.keys, cache.values, *cache.window_keys.values(), *cache.window_values.values()]
    snapshot = [buffer.clone() for buffer in buffers]

    def restore():
        for buffer, saved in zip(buffers, snapshot):
            buffer.copy_(saved)

    def run(step_fn, rows):
        """STEPS greedy steps of the given rows -> logits per step."""
        chosen = [sequences[r] for r in rows]
        out = []
        with torch.inference_mode():
            block_table = cache.block_tables([s.block_table for s in chosen], 4)  # [B, 4]: every block a row may own
            tokens = torch.tensor([s.output_ids[-1] for s in chosen])
            positions = torch.tensor([s.num_tokens - 1 for s in chosen])
            for _ in range(STEPS):
                # a sliding kind's blocks are taken as its tokens are written (engine/slots.py)
                for sequence, position in zip(chosen, positions.tolist()):
                    cache.prepare(sequence.block_table, position, position + 1)
                windowed = decode_window_tables(cache, [s.block_table for s in chosen], positions.tolist())
                logits, tokens = step_fn(block_table, tokens, positions, windowed)
                out.append(logits.clone())
                positions = positions + 1
        return out

    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    bound = functools.partial(decode_step, gen.model, cache, engine.windows, engine.score_bias,
                              decode_products(gen.model))
    compiled = torch.compile(bound, backend=counting_backend, fullgraph=True, dynamic=False)
    for rows in ([0, 1, 2, 3], [1, 3]):  # two buckets: B = 4 and B = 2
        restore()
        eager = run(bound, rows)
        restore()
        traced = run(compiled, rows)
        for a, b in zip(eager, traced):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    assert len(graphs) == 2  # one graph per bucket, none per step

    restore()  # the fixed-shape step chooses what the engine's own steps choose
    eager = run(bound, [0, 1, 2, 3])
    restore()
    for step in range(STEPS):
        events = engine.step()
        assert [e.token_id for e in events] == eager[step].argmax(-1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama-gqa", "mistral", "bloom", "gpt2"])
def test_the_engine_decodes_through_the_compiled_step_with_unchanged_tokens(kind):
    """compile_decode: the engine's pure-decode steps run the traced fixed-shape step (padded to
    row and block buckets); every request's tokens equal the varlen engine's, next to requests
    arriving later with other options (the mistral prompts pass its window)."""
    from engine_helpers import run_arrivals
    from fastdecode.engine.compiled import CompiledDecode

    gen = fastdecode.from_hf(build(kind))
    requests = [(torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist(), options)
                for n, options in [(13, {"max_new_tokens": 20}), (3, {"max_new_tokens": 9, "do_sample": True, "seed": 5}),
                                   (21, {"max_new_tokens": 12, "repetition_penalty": 1.3}), (6, {"max_new_tokens": 15})]]
    arrivals = {0: requests[:2], 3: requests[2:3], 7: requests[3:]}
    expected = run_arrivals(gen.engine(max_batch_tokens=16), dict(arrivals))
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    engine = gen.engine(max_batch_tokens=16)
    engine.runner.compiled = CompiledDecode(engine.runner, backend=counting_backend)
    assert run_arrivals(engine, dict(arrivals)) == expected
    assert 1 <= len(graphs) <= 8  # one per (rows, blocks) bucket met, not one per step
    assert engine.cache.pool.num_free == engine.cache.pool.num_blocks - 1  # only the scratch block stays


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-swa"])
def test_fixed_shape_step_keeps_its_scratch_block_beside_the_capacity_asked(kind):
    """The padding rows' scratch block comes on top of ``cache_tokens``: a cache sized for exactly one
    request (as generate sizes it) still admits that request (it used to wait for ever)."""
    gen = fastdecode.from_hf(build(kind))
    engine = gen.engine(cache_tokens=32, compile_decode=True)  # 2 blocks of 16 for 19 + 12 tokens
    sequence = engine.submit(list(range(3, 22)), {"max_new_tokens": 12})
    engine.step()  # the prompt (eager: compiling happens at the first pure decode step)
    assert sequence in engine.running and sequence.num_computed == 19 and len(sequence.output_ids) == 1
