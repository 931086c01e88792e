"""The float32 GEMM: F.linear on the exact float32 GEMM the model's kernel choice names, with the
activation fused into it where that GEMM can.

PyTorch's CPU ``F.linear`` calls MKL's sgemm; oneDNN's float32 GEMM, which PyTorch ships as
``torch.ops.mkldnn._linear_pointwise`` (inductor's CPU linear; called through layers/ops.py), runs on
the same canonical [in, out] buffers. Which one is faster depends on the CPU (layers/gemm_choice.py
measures it once per machine; ``KernelChoice.float_gemm`` carries the answer). Both are float32
throughout (products and accumulation; no bf16/tf32 "fast math" unless the user enables it in
``torch.backends.mkldnn``); results differ only by summation order (~1e-6). On oneDNN, ReLU and
GELU (erf or tanh) run as the GEMM's epilogue, saving a pass over the FFN activations (bit-identical
for ReLU and erf GELU). Anything else (MKL, CUDA, half precision, a build without oneDNN, autograd,
torch.compile) runs ``F.linear`` + the activation. Prompt rows of float and quantized products
(layers/linear.py, layers/quantized.py) run here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .threads import threads_for

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}
# The same activations in place, bit for bit, for a product's fresh output: no second [rows, out] buffer
# (an encoder's [2048, 3072] FFN output is 24 MB, whose pages glibc handed back to the OS and mapped
# again at every layer once two such buffers were free at the top of its heap: ~50-90k page faults per
# bart-base int8 beam call, 8 x 256 sources).
_IN_PLACE = {
    "gelu": lambda x: torch.ops.aten.gelu_.default(x),  # the overload, not the packet: ~5 us less a call
    "gelu_new": lambda x: torch.ops.aten.gelu_.default(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: torch.ops.aten.gelu_.default(x, approximate="tanh"),
    "relu": F.relu_,
    "silu": lambda x: F.silu(x, inplace=True),
    "swish": lambda x: F.silu(x, inplace=True),
}
assert _IN_PLACE.keys() == ACTIVATIONS.keys()
# activation name -> oneDNN post-op (attribute, algorithm); SiLU is not faster fused, so it is not.
_FUSED = {"relu": ("relu", ""), "gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"),
          "gelu_pytorch_tanh": ("gelu", "tanh")}
_ONEDNN = ops.onednn_available()
# An activation's cost per element in multiply-adds of a product (GELU's erf: 0.6 ns per float on one core),
# for threads_for: a decode step's [32, 3072] stays on one thread, an encoder's [2048, 3072] gets the budget.
ACTIVATION_WORK = 32


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
         threads: int, float_gemm: str) -> torch.Tensor:
    """act(x [..., in] @ weight [out, in]^T + bias) -> [..., out] on the float GEMM ``float_gemm``
    ("onednn" or "mkl": the model's ``KernelChoice``), split over up to ``threads`` (the forward's
    budget) when it is big."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled():
        out = F.linear(x, weight, bias)
        return out if activation is None else ACTIVATIONS[activation](out)
    if float_gemm == "onednn" and _ONEDNN and not torch.compiler.is_compiling():  # inductor picks its own GEMM
        attr, algorithm = _FUSED.get(activation, ("none", ""))
        with threads_for(x.numel() * weight.shape[0], threads):  # rows * in * out
            out = ops.onednn_linear(x, weight, bias, attr, algorithm)
        return out if activation is None or activation in _FUSED else ACTIVATIONS[activation](out)
    with threads_for(x.numel() * weight.shape[0], threads):  # rows * in * out
        out = F.linear(x, weight, bias)
    return activated(out, activation, threads)


def fuses(activation: str | None, float_gemm: str) -> bool:
    """Whether the GEMM ``float_gemm`` runs ``activation`` as its epilogue (oneDNN's ReLU and GELU)."""
    return activation in _FUSED and float_gemm == "onednn" and _ONEDNN


def activated(out: torch.Tensor, activation: str | None, threads: int) -> torch.Tensor:
    """act(out) of a product's fresh output, in place (out of place under autograd), on up to ``threads``
    where it is big (an encoder's [2048, 3072]: GELU takes 3.9 ms on one core, 1.4 ms on two; ATen's
    element-wise results do not depend on the thread count)."""
    if activation is None:
        return out
    with threads_for(out.numel() * ACTIVATION_WORK, threads):
        return (ACTIVATIONS if torch.is_grad_enabled() else _IN_PLACE)[activation](out)
