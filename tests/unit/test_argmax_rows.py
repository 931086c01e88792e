"""The greedy step's argmax op (layers/argmax.cpp) picks the index torch.argmax(dim=-1) picks: the first
maximum (ties, -0.0 beside 0.0), the first NaN where a row has one, a row of -inf's first index, every
length (vector bodies and tails)."""

from __future__ import annotations

import pytest
import torch

from fastdecode.decoding.sampling import greedy_tokens
from fastdecode.layers import ops

needs_kernels = pytest.mark.skipif(not ops.available(), reason="the extension's kernels are not built here")


def _rows(V: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of every hard case at length V: random, coarse ties, signed zeros, NaNs, infinities."""
    rows = [torch.randn(V, generator=generator), torch.randint(-3, 3, (V,), generator=generator).float(),
            torch.zeros(V), torch.full((V,), float("-inf")), torch.full((V,), float("nan"))]
    zeros = torch.zeros(V)
    zeros[V // 2:] = -0.0
    zeros[0] = -0.0
    rows.append(zeros)
    for where in {0, V // 3, V - 1}:
        with_nan = torch.randn(V, generator=generator)
        with_nan[where] = float("nan")
        with_nan[-1] = float("nan")
        rows.append(with_nan)
        with_inf = torch.randn(V, generator=generator)
        with_inf[where] = float("inf")
        rows.append(with_inf)
        top_twice = torch.randn(V, generator=generator)
        top_twice[where] = top_twice[-1] = 9.0
        rows.append(top_twice)
    return torch.stack(rows)  # [R, V]


@needs_kernels
@pytest.mark.parametrize("V", [1, 7, 8, 9, 31, 64, 1000, 49152])
def test_argmax_rows_picks_torchs_index(V):
    logits = _rows(V, torch.Generator().manual_seed(V))
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    strided = logits.t().contiguous().t()  # the same rows, not contiguous
    assert torch.equal(ops.argmax_rows(strided), logits.argmax(dim=-1))


def test_other_dtypes_take_torchs_argmax():
    logits = torch.randn(3, 50, dtype=torch.float64)
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert torch.equal(greedy_tokens(logits.to(torch.bfloat16)), logits.to(torch.bfloat16).argmax(dim=-1))
