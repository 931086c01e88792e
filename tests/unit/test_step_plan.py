"""The step plan's prompt chunks (engine/plan.py): a chunk whose slots and blocks are consecutive (a
sequence's first chunk in a new engine) is written with one copy and attended from the cache's buffers
in place, with neither ``index_copy_`` nor a gather; its logits and cached K/V are the bits of the same
chunk in blocks in another order (written slot by slot, gathered)."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.engine import Engine
from fastdecode.engine.blocks import BlockTable
from fastdecode.engine.plan import StepPlan
from fastdecode.engine.slots import SlotCache
from fastdecode.layers.products import Products
from tiny_models import VOCAB, build, build_gemma3

pytest.importorskip("transformers")

BLOCK, LENGTH = 4, 30  # the last block partly filled


@pytest.fixture(scope="module", params=["llama-gqa", "gemma3"])
def gen(request):
    hf = build_gemma3(seed=3, sliding_window=12) if request.param == "gemma3" else build("llama-gqa", seed=2)
    return fastdecode.from_hf(hf)


def _run(engine: Engine, table: BlockTable, prompt: list[int]) -> torch.Tensor:
    model = engine.model
    products = Products.of_rows(True, 2, model.device, kernels=model.kernels)
    plan = StepPlan.for_rows(engine.cache, [(table, 0, len(prompt))], engine.windows, engine.score_bias,
                             model.dtype, products)
    with torch.inference_mode():
        return model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], plan, all_logits=True)


def _cached(cache: SlotCache, table: BlockTable) -> list[torch.Tensor]:
    """Every layer's keys and values at the table's slots, in position order."""
    rows = []
    for layer, kind in enumerate(cache.layer_windows):
        blocks = list(table) if kind is None else table.windows[kind]
        ids = torch.tensor(blocks)[None]  # [1, n]
        rows += [cache.gather(buffer, ids)[:, :, :LENGTH] for buffer in (cache.layer_keys[layer], cache.layer_values[layer])]
    return rows


def _not_called(*args, **kwargs):
    raise AssertionError("a consecutive prompt chunk is written and read in place")


def test_a_consecutive_chunk_reads_in_place_with_the_bits_of_any_block_order(gen, monkeypatch):
    prompt = torch.randint(2, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(5)).tolist()
    engine = Engine(gen.model, gen.requests, block_size=BLOCK, cache_tokens=4 * LENGTH)
    consecutive, other = engine.cache.take(LENGTH), engine.cache.take(LENGTH)
    reversed_table = BlockTable(other[::-1], {w: blocks[::-1] for w, blocks in other.windows.items()})
    expected = _run(engine, reversed_table, prompt)
    with monkeypatch.context() as patch:
        patch.setattr(SlotCache, "gather", _not_called)
        patch.setattr(torch.Tensor, "index_copy_", _not_called)
        ours = _run(engine, consecutive, prompt)
    assert torch.equal(ours, expected)
    assert all(torch.equal(a, b) for a, b in zip(_cached(engine.cache, consecutive), _cached(engine.cache, reversed_table)))
