"""A decoder block's element-wise steps as single ops: RMSNorm, residual add + next norm, a fused
Q/K/V output split into heads with RoPE on queries and keys (and Gemma's per-head norms), the
gated MLP activation.

At decode each of these touches a few thousand floats, and the time goes to dispatching PyTorch
ops (F.rms_norm alone runs seven on CPU). float32 CPU tensors go to the fused AVX2 kernels of
``elementwise.cpp`` (one op each); anything else, or a machine without the extension, takes the
PyTorch path below, the reference the kernels match up to the sum of squares' summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import ops
from .gemm import ACTIVATIONS
from .positions import rotate_heads

# activation name -> the kernel's activation code (others run in PyTorch)
GATED_KINDS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1, "gelu_new": 1}
# From this many floats (a prompt's rows, not a decode step's) an op's rows are split over the forward's
# threads (``threads``: ``Products.threads``): each row computed alone, so the same bits.
SPLIT_MIN_FLOATS = 1 << 16


def _split_threads(x: torch.Tensor, threads: int) -> int:
    """The threads an op over ``x`` splits its rows over: ``threads`` for a big one, else 1."""
    return threads if threads > 1 and x.numel() >= SPLIT_MIN_FLOATS and not torch.compiler.is_compiling() else 1


def elementwise_ops():
    """The ops module (layers/ops.py) where the extension is built, else None (the PyTorch path)."""
    return ops if ops.available() else None


def _kernels(x: torch.Tensor):
    """The ops module when x can use it, else None."""
    if x.dtype is not torch.float32 or not x.is_cpu:
        return None
    return elementwise_ops()


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., C] normalized over C, times weight [C] (None: no scale) -> [..., C]."""
    ops = _kernels(x)
    if ops is None:
        if x.dtype in HALF:
            return _half_rms_norm(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return ops.rms_norm(x, weight, eps)


HALF = (torch.bfloat16, torch.float16)


def _half_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A half-precision RMSNorm, computed in float32 (PyTorch's fused op does so) and rounded once; a
    float32 weight (Gemma's 1 + w, which transformers adds and applies in float32) scales it before
    that rounding, as transformers does. (Llama's transformers norm rounds twice, before and after its
    half-precision weight: the single rounding is as close to float32 and one kernel.)"""
    if weight is None or weight.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 delta_weight: torch.Tensor | None = None, threads: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm: x, delta [..., C] -> (s, rms_norm(s, weight)) with
    s = x + delta, or x + rms_norm(delta, delta_weight) where ``delta_weight`` is given (Gemma's
    post-attention and post-MLP norms). ``threads``: the forward's budget (big inputs split their rows)."""
    ops = _kernels(x)
    if ops is None or delta.dtype != x.dtype:
        s = x + (delta if delta_weight is None else rms_norm(delta, delta_weight, eps))
        return s, rms_norm(s, weight, eps)
    return ops.add_rms_norm(x, delta, delta_weight, weight, eps, _split_threads(x, threads))


def qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, signed_sin: torch.Tensor,
              norm_weight: torch.Tensor | None = None, eps: float = 0.0, threads: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused Q/K/V product's output qkv [B, T, (H + 2 Hkv) D] -> q [B, H, T, D], k, v [B, Hkv, T, D].
    Query and key heads are RMS-normed over D and scaled by norm_weight [H + Hkv, D] if given (Gemma),
    then rotated with ``RotaryEmbedding.tables`` (cos, signed sin [B, T, 1, rot]). ``threads``: as
    ``add_rms_norm``'s."""
    ops = _kernels(qkv)
    if ops is not None and qkv.stride(-1) == 1:
        return ops.qkv_heads(qkv, num_heads, num_kv_heads, norm_weight, eps, cos, signed_sin,
                             _split_threads(qkv, threads))
    B, T, width = qkv.shape
    H, Hkv = num_heads, num_kv_heads
    heads = qkv.view(B, T, H + 2 * Hkv, width // (H + 2 * Hkv))  # [B, T, H + 2*Hkv, D]: q, k, v heads
    qk = heads[:, :, : H + Hkv]  # [B, T, H + Hkv, D]
    if norm_weight is not None and qk.dtype in HALF:
        qk = (F.rms_norm(qk.float(), (qk.shape[-1],), None, eps) * norm_weight.float()).to(qk.dtype)
    elif norm_weight is not None:
        qk = F.rms_norm(qk, (qk.shape[-1],), None, eps) * norm_weight
    qk = rotate_heads(qk, cos, signed_sin)  # q and k at once
    return qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2), heads[:, :, H + Hkv :].transpose(1, 2)


def gated(gate_up: torch.Tensor, activation: str, threads: int = 1) -> torch.Tensor:
    """gate_up [..., 2I] = [gate | up] -> act(gate) * up [..., I] (act an ``ACTIVATIONS`` name); ``threads``: as
    ``add_rms_norm``'s."""
    ops = _kernels(gate_up)
    kind = GATED_KINDS.get(activation)
    if ops is None or kind is None:
        gate, up = gate_up.chunk(2, dim=-1)  # [..., I] each
        return ACTIVATIONS[activation](gate) * up
    return ops.gated(gate_up, kind, _split_threads(gate_up, threads))
