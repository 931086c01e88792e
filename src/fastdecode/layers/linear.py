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

Generated rows (decode steps, beams; ``quantized.prompt_rows`` marks the others) of a float32 matrix
held as a contiguous [in, out] buffer take the extension's ``float_matmul`` (layers/fmatmul.cpp)
instead: each output summed in one fixed order (fused multiply-add chains over segments of 64 inputs,
added in order), so a row's result is the same whatever else is in the product, and the work split
over the kernel thread pool (at batch 1 segments of whole rows, each thread streaming its own), which
uses the second core's memory bandwidth that the one-thread GEMM leaves idle. Prompt rows keep the
GEMM (compute-bound there); a step mixing both runs each part its own way, like the quantized kernels
(its logits layer, over the rows picked for logits, takes the kernel for every row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import float_matmul_op
from .quantized import _ROLES, ALL_PROMPT, QuantizedWeight, embed, quantized_linear  # noqa: F401 - embed: one import for models
from .threads import kernel_threads, threads_for

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
# An activation's cost per element in multiply-adds of a product (GELU's erf: 0.6 ns per float on one core),
# for threads_for: a decode step's [32, 3072] stays on one thread, an encoder's [2048, 3072] gets the caller's.
ACTIVATION_WORK = 32
USE_FLOAT_KERNEL = True  # False: generated rows take the GEMM too (tests, benchmarks of the old path)


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """act(x [..., in] @ weight [out, in]^T + bias [out]) -> [..., out]; ``activation`` names an ACTIVATIONS entry."""
    if isinstance(weight, QuantizedWeight):
        return _activated(quantized_linear(x, weight, bias), activation)
    op = _float_kernel(x, weight)
    if op is not None:
        roles = None if torch.compiler.is_compiling() else _ROLES.get()  # compiled graphs are decode steps
        if roles is not ALL_PROMPT:
            return _activated(_generated_rows_product(op, x, weight, bias, roles), activation)
    if (_ONEDNN and x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):  # inductor picks its own GEMM for F.linear
        return _gemm(x, weight, bias, activation)
    out = F.linear(x, weight, bias)
    return out if activation is None else ACTIVATIONS[activation](out)


def _activated(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """act(out), on the caller's threads where it is big (an encoder's [2048, 3072]: GELU takes 3.9 ms on
    one core, 1.4 ms on two; ATen's element-wise results do not depend on the thread count)."""
    if activation is None:
        return out
    with threads_for(out.numel() * ACTIVATION_WORK):
        return ACTIVATIONS[activation](out)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """oneDNN's float32 GEMM, the activation fused where it can be (F.linear where oneDNN is missing)."""
    if not _ONEDNN:
        out = F.linear(x, weight, bias)
        return out if activation is None else ACTIVATIONS[activation](out)
    attr, algorithm = _FUSED.get(activation, ("none", ""))
    with threads_for(x.numel() * weight.shape[0]):  # rows * in * out
        out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)
    return out if activation is None or activation in _FUSED else ACTIVATIONS[activation](out)


def _float_kernel(x: torch.Tensor, weight: torch.Tensor):
    """The extension's float_matmul op where it can run this product (float32 CPU, no autograd, the
    weight a view of a contiguous [in, out] buffer), else None."""
    if (not USE_FLOAT_KERNEL or x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu
            or not weight.is_cpu or torch.is_grad_enabled() or not weight.t().is_contiguous()):
        return None
    return float_matmul_op()


def _generated_rows_product(op, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, roles) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias -> [..., N]: generated rows through the kernel, prompt rows
    (``roles``: a ``RowRoles``; None: every row generated) through the GEMM. A product of other rows than
    the roles' (the logits layer of a mixed step: the rows ``output_rows`` picked) runs every row through
    the kernel, as the quantized logits layer (``for_logits``) does whatever the roles."""
    N, K = weight.shape
    rows = x.reshape(-1, K)  # [M, K]
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    if roles is None or rows.shape[0] != roles.rows:  # (other rows than the forward's: the logits layer's)
        out = _kernel_rows(op, rows, weight, bias)
    else:
        out = rows.new_empty(rows.shape[0], N)
        out[roles.generated] = _kernel_rows(op, rows[roles.generated], weight, bias)
        out[roles.prompt] = _gemm(rows[roles.prompt], weight, bias, None)
    return out.view(*x.shape[:-1], N)  # [..., N]


def _kernel_rows(op, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] -> [M, N] through float_matmul (weight.t(): the [in, out] buffer)."""
    M, K = rows.shape
    return op(rows if rows.is_contiguous() else rows.contiguous(), weight.t(), bias, kernel_threads(M * K * weight.shape[0]))
