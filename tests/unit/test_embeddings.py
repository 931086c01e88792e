"""Embeddings (``Generator.embed``, engine sequences: engine/embedding_rows.py): mean and last-token
pooling of the final normed hidden states equal transformers' ``hidden_states[-1]`` pooled the same
way, for every decoder family, and equal the one padded no-cache forward that served them before
(tests/embedding_reference.py) to 1e-5."""

from __future__ import annotations

import pytest
import torch

import fastdecode
from embedding_reference import reference_embeddings
from tiny_models import build

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 9, 14, 20, 3, 44, 17], [7, 8], [11, 12, 13, 90]]


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-swa", "olmo2", "gemma3", "bloom", "gpt2"])
def test_pooled_hidden_states_match_transformers(kind):
    hf = build(kind, seed=1)
    gen = fastdecode.from_hf(hf)
    for pooling in ("mean", "last"):
        ours = gen.embed(PROMPTS, pooling)  # [3, C]: three sequences of one engine
        torch.testing.assert_close(ours, reference_embeddings(gen.model, PROMPTS, pooling), atol=1e-5, rtol=0)
        for row, prompt in enumerate(PROMPTS):
            with torch.no_grad():
                states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]  # [T, C]
            pooled = states.mean(dim=0) if pooling == "mean" else states[-1]
            expected = torch.nn.functional.normalize(pooled.float(), dim=-1)
            assert torch.allclose(ours[row], expected, atol=1e-4), (kind, pooling, row)
            assert torch.allclose(ours[row], gen.embed([prompt], pooling)[0], atol=1e-5)  # batched == alone
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(PROMPTS)), atol=1e-5)


@pytest.mark.parametrize("prompt_rows", ["exact", "int8-mlp"])
def test_the_embedded_model_embeds_as_before(prompt_rows, smollm_exact, smollm):
    """To 1e-5 on exact prompt rows. On the default (the MLP's prompt rows on int8) to 0.02: the reference
    forward's attention sums differ from the engine's in the last bit, which the int8 rounding of the next
    MLP product can turn into a whole code step."""
    smollm = smollm_exact if prompt_rows == "exact" else smollm
    bound = 1e-5 if prompt_rows == "exact" else 0.02
    texts = ["The capital of France is Paris.", "Hi", "A cat sat on the mat and looked at the moon. " * 6]
    ids = [smollm.tokenizer.encode(t) for t in texts]
    for pooling in ("mean", "last"):
        ours = smollm.embed(texts, pooling)
        assert ours.shape == (3, smollm.config.hidden_size)
        expected = torch.stack([reference_embeddings(smollm.model, [p], pooling)[0] for p in ids])
        torch.testing.assert_close(ours, expected, atol=bound, rtol=0)
