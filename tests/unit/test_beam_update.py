"""``beam_update`` (layers/beam_update.cpp): one sample's beam bookkeeping after its step's candidates, as one
C++ op on the state in place, against the ~35 tensor ops it replaces (engine/beam_scores.py's
``_update_torch``): every state tensor and every answer bitwise the same, step after step, with EOS candidates
inside and past the first K, the last step's hits, equal scores (ties keep their order of position in both),
the three ``early_stopping`` settings and length penalties whose divisors are not exact in float32 (whole beam
searches with and without it: tests/unit/test_beam_ops.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_encdec import single_thread  # noqa: F401 (autouse fixture)

from fastdecode.config import GenerationConfig
from fastdecode.engine import beam_scores as beam_module
from fastdecode.layers import ops

needs_kernels = pytest.mark.skipif(not ops.available(), reason="no AVX2 extension: PyTorch paths run")
STATE = ("running", "running_tokens", "fin_tokens", "fin_length", "fin_scores", "fin_done", "improvable")


def random_candidates(g: torch.Generator, K: int, V: int, keep: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's candidates: scores [1, keep] best first (on a coarse grid, so that some are equal; at the first
    step only beam 0's tokens, as its other beams start at NEG), distinct flat indices beam * V + token."""
    beams = 1 if step == 0 else K
    index = torch.randperm(beams * V, generator=g)[:keep]
    scores = -(torch.randint(0, 24, (keep,), generator=g).float() * 0.25 + step * 0.5)
    return scores.sort(descending=True).values[None], index[None]


@needs_kernels
@pytest.mark.parametrize("K, eos", [(3, [2]), (4, [1, 5]), (2, [0])])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 2.0, 0.7, -0.3])
def test_beam_update_op_is_the_torch_update_bitwise(K, eos, early_stopping, length_penalty):
    V, max_new = 13, 9  # a small vocabulary: EOS among the candidates often
    config = GenerationConfig(num_beams=K, max_new_tokens=max_new, early_stopping=early_stopping,
                              length_penalty=length_penalty)
    by_op = beam_module.BeamScores(config, eos, torch.device("cpu"))
    by_torch = beam_module.BeamScores(config, eos, torch.device("cpu"))
    g = torch.Generator().manual_seed(K * 100 + len(eos))
    for step in range(max_new):
        scores, index = random_candidates(g, K, V, by_op.n_keep, step)
        answer = by_op._update_with_op(ops.beam_update, scores, index, V, step)
        expected = by_torch._update_torch(scores, index, V, step)
        assert answer[0] == expected[0]
        assert torch.equal(answer[1], expected[1]) and torch.equal(answer[2], expected[2])
        for name in STATE:
            mine, theirs = getattr(by_op, name), getattr(by_torch, name)
            assert mine.dtype == theirs.dtype and torch.equal(mine.view(theirs.shape), theirs), (step, name)
        if not expected[0]:
            break


@needs_kernels
def test_beam_update_rejects_bad_input():
    config = GenerationConfig(num_beams=2, max_new_tokens=4)
    state = beam_module.BeamScores(config, [2], torch.device("cpu"))
    scores = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])
    with pytest.raises(RuntimeError, match="outside 2 x 5"):
        state._update_with_op(ops.beam_update, scores, torch.tensor([[0, 1, 2, 10]]), 5, 0)
    with pytest.raises(RuntimeError, match="at least 2K"):
        state._update_with_op(ops.beam_update, scores[:, :3], torch.tensor([[0, 1, 2]]), 5, 0)
    with pytest.raises(RuntimeError, match="outside the 4 token columns"):
        state._update_with_op(ops.beam_update, scores, torch.tensor([[0, 1, 2, 3]]), 5, 4)
