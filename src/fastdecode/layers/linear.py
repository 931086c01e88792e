"""``linear``: F.linear on the fastest exact float32 GEMM PyTorch offers on this CPU, with the
activation fused into it where possible.

PyTorch's CPU ``F.linear`` calls MKL's sgemm; oneDNN's float32 GEMM, which PyTorch ships as
``torch.ops.mkldnn._linear_pointwise`` (inductor's CPU linear), is faster on the same canonical
[in, out] buffers (figures: benchmarks/README.md). It is float32 throughout (products and
accumulation; no bf16/tf32 "fast math" unless the user enables it in ``torch.backends.mkldnn``);
results differ from MKL's only by summation order (~1e-6). ReLU and GELU (erf or tanh) run as the
GEMM's epilogue, saving a pass over the FFN activations (bit-identical for ReLU and erf GELU).
Anything else (CUDA, half precision, a build without oneDNN) keeps ``F.linear`` + the activation.
A ``QuantizedWeight`` goes to its own kernels (``quantized.py``).
Small products run on one thread (``threads.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quantized import QuantizedWeight, embed, quantized_linear  # noqa: F401 - embed: one import for models
from .threads import threads_for

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# activation name -> oneDNN post-op (attribute, algorithm); SiLU is not faster fused, so it is not.
_FUSED = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
          "gelu_pytorch_tanh": ("gelu", "tanh")}
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """act(x [..., in] @ weight [out, in]^T + bias [out]) -> [..., out]; ``activation`` names an ACTIVATIONS entry."""
    if isinstance(weight, QuantizedWeight):
        out = quantized_linear(x, weight, bias)
        return out if activation is None else ACTIVATIONS[activation](out)
    if (_ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):  # inductor picks its own GEMM for F.linear
        attr, algorithm = _FUSED.get(activation, ("none", ""))
        with threads_for(x.numel() * weight.shape[0]):  # rows * in * out
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
        return out if activation is None or activation in _FUSED else ACTIVATIONS[activation](out)
    out = F.linear(x, weight, bias)
    return out if activation is None else ACTIVATIONS[activation](out)
