"""Embeddings (``generation/embedding.py``): mean and last-token pooling of the final normed hidden
states equal transformers' ``hidden_states[-1]`` pooled the same way, for every decoder family, and a
padded batch equals each sequence alone."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from fastdecode.generation.embedding import embed_token_lists
from tiny_models import build

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 9, 14, 20, 3, 44, 17], [7, 8], [11, 12, 13, 90]]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-swa", "olmo2", "gemma3", "bloom", "gpt2"])
def test_pooled_hidden_states_match_transformers(kind):
    hf = build(kind, seed=1)
    gen = fastdecode.from_hf(hf)
    for pooling in ("mean", "last"):
        ours = embed_token_lists(gen.model, PROMPTS, pooling)  # one padded batch
        for row, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]  # [T, C]
            pooled = states.mean(dim=0) if pooling == "mean" else states[-1]
            expected = torch.nn.functional.normalize(pooled.float(), dim=-1)
            assert torch.allclose(ours[row], expected, atol=1e-4), (kind, pooling, row)
            assert torch.allclose(ours[row], embed_token_lists(gen.model, [prompt], pooling)[0], atol=1e-5)
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(PROMPTS)), atol=1e-5)
