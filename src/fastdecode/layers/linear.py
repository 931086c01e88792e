"""``linear``: F.linear on the fastest exact float32 GEMM PyTorch offers on this CPU.

PyTorch's CPU ``F.linear`` calls MKL's sgemm. On our AMD EPYC (AVX-512) oneDNN's float32 GEMM, which
PyTorch ships as ``torch.ops.mkldnn._linear_pointwise`` (inductor's CPU linear), measured 2-3x faster
on encoder-sized products (2048 x 768 -> 3072) and 1.5-4x on decode steps (8 x 768 -> 50265 and
the layer projections), on the same canonical [in, out] buffers, single thread. It is float32
throughout (products and accumulation; no bf16/tf32 "fast math" unless the user enables it in
``torch.backends.mkldnn``); results differ from MKL's only by summation order (~1e-6).
Anything else (CUDA, half precision, a build without oneDNN) keeps ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias [out]) -> [..., out], as ``F.linear``."""
    if _ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled():
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
