"""``linear``: one product of a forward, routed by its weight and its rows' roles.

A ``QuantizedWeight`` goes to its own kernels (``quantized.py``); a float weight to the float32 GEMM
(``gemm.py``: oneDNN's, the activation fused) or, for generated rows, the extension's kernel below.
Every call names the forward's ``Products`` (layers/products.py: the rows' roles, the thread budget
and the model's kernel choice), taken from the step plan the model received: nothing else decides
the arithmetic.

Generated rows (decode steps, beams; ``Products.roles`` marks the others) of a float32 matrix held
as a contiguous [in, out] buffer take the extension's ``float_matmul`` (layers/fmatmul.cpp) instead
of the GEMM: each output summed in one fixed order (fused multiply-add chains over segments of 64
inputs, added in order), so a row's result is the same whatever else is in the product, and the work
split over the kernel thread pool (at batch 1 segments of whole rows, each thread streaming its own),
which uses the second core's memory bandwidth that the one-thread GEMM leaves idle. Prompt rows take
the kernel too where the model's kernel choice says so (``KernelChoice.prompt_kernel``: measured at load,
layers/gemm_choice.py; a step's prompt and generated rows are then one product, on the kernel pool, with
no OpenMP team beside it), except where the GEMM fuses their activation (oneDNN's GELU or ReLU: a pass over
the output saved); otherwise they keep the GEMM, and a step mixing both runs each part its own
way, like the quantized kernels (its logits layer, over the rows picked for logits, takes the kernel for
every row).

A float32 model may hold a matrix in float16 where every value of it is a float16 value (Whisper's
float16 checkpoints: models/whisper.py's ``hold_in_half``): generated rows read it as it is (the kernel
widens each weight as it loads it: the float32 buffer's bits, half the bytes streamed), prompt rows take
the GEMM on its float32 values (``widened``), so every product is the float32 model's.
"""

from __future__ import annotations

import torch

from . import ops
from .gemm import ACTIVATIONS, activated, fuses, gemm  # noqa: F401 - ACTIVATIONS: one import for models
from .products import KernelChoice, Products, RowRoles
from .quantized import QuantizedWeight, embed, quantized_linear  # noqa: F401 - embed: one import for models
from .threads import kernel_threads, threads_for

WIDEN_WORK = 4  # a float16 value widened into fresh float32 memory, in multiply-adds (for threads_for)


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None = None,
    activation: str | None = None, *, products: Products,
) -> torch.Tensor:
    """act(x [..., in] @ weight [out, in]^T + bias [out]) -> [..., out]; ``activation`` names an ACTIVATIONS
    entry; ``products``: the forward's row roles, thread budget and kernel choice."""
    if isinstance(weight, QuantizedWeight):
        return activated(quantized_linear(x, weight, bias, products), activation, products.threads)
    if (x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled()
            and float_kernel_serves(weight, products.kernels)):
        kernels = products.kernels
        # prompt rows through the kernel where the choice says so, unless the GEMM would fuse their activation (a
        # GELU FFN's: a pass over [rows, out] saved)
        if products.roles is None or (kernels.prompt_kernel and not fuses(activation, kernels.float_gemm)):
            return activated(_kernel_product(x, weight, bias, products), activation, products.threads)
        if not products.all_prompt:
            return activated(_generated_rows_product(x, weight, bias, products), activation, products.threads)
    return gemm(x, widened(weight, x, products.threads), bias, activation, products.threads,
                products.kernels.float_gemm)


def widened(weight: torch.Tensor, x: torch.Tensor, threads: int) -> torch.Tensor:
    """A float16-held matrix of a float32 model as its float32 values for the GEMM (the same strides: an
    [out, in] view of an [in, out] buffer, as the float32 model's; a big one on up to ``threads``: base's
    logits layer, 26.5M values, once per prompt step), any other weight as it is."""
    if weight.dtype == torch.float16 and x.dtype == torch.float32:
        with threads_for(weight.numel() * WIDEN_WORK, threads):
            return weight.float()
    return weight


def float_kernel_serves(weight: torch.Tensor, kernels: KernelChoice) -> bool:
    """Whether the extension's float_matmul runs generated rows (float32 on the CPU, no autograd) times
    this weight: the kernel choice allows it (``float_kernel``; off: the GEMM, the old path), float32 (or
    a float32 model's float16-held matrix) on the CPU, an [out, in] view of a contiguous [in, out] buffer."""
    return (kernels.float_kernel and weight.dtype in (torch.float32, torch.float16) and weight.is_cpu
            and weight.t().is_contiguous() and ops.available())


def _kernel_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    products: Products) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias -> [..., N], every row through the kernel."""
    N, K = weight.shape
    rows = x.reshape(-1, K)  # [M, K]
    return _kernel_rows(rows, weight, kernel_bias(bias), products).view(*x.shape[:-1], N)  # [..., N]


def kernel_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the float kernel reads it: contiguous float32 (a float16-held model's, widened); also the fused
    decode blocks' (models/llama_decode.py)."""
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return bias.float().contiguous()
    return bias


def _generated_rows_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            products: Products) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T + bias -> [..., N] of a step mixing roles (``products.roles``: a
    ``RowRoles``): generated rows through the kernel, prompt rows through the GEMM. A product of other
    rows than the roles' (the logits layer of a mixed step: the rows ``output_rows`` picked) runs every
    row through the kernel, as the quantized logits layer (``for_logits``) does whatever the roles."""
    N, K = weight.shape
    roles = products.roles
    if not isinstance(roles, RowRoles) or x.numel() // K != roles.rows:  # (the logits layer's other rows)
        return _kernel_product(x, weight, bias, products)
    rows, bias = x.reshape(-1, K), kernel_bias(bias)  # [M, K]
    out = rows.new_empty(rows.shape[0], N)
    out[roles.generated] = _kernel_rows(rows[roles.generated], weight, bias, products)
    out[roles.prompt] = gemm(rows[roles.prompt], widened(weight, rows, products.threads), bias, None,
                             products.threads, products.kernels.float_gemm)
    return out.view(*x.shape[:-1], N)  # [..., N]


def _kernel_rows(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 products: Products) -> torch.Tensor:
    """rows [M, K] -> [M, N] through float_matmul (weight.t(): the [in, out] buffer), on the forward's thread
    budget, with the model's in-place row limits (``KernelChoice.in_place_rows``)."""
    M, K = rows.shape
    return ops.float_matmul(rows if rows.is_contiguous() else rows.contiguous(), weight.t(), bias,
                            kernel_threads(M * K * weight.shape[0], products.threads), *products.kernels.in_place_rows)
