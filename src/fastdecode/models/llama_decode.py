"""Pure decode steps of a quantized Llama-family model: one op per block (layers/decode_block.cpp).

A batch-1 decode step of SmolLM2-135M is 30 blocks of ten small ops; dispatching them from Python
costs about 150 us per block, as much as the products themselves on two cores. When a step allows
it, ``LlamaModel.forward`` hands each block to ``decode_block``, which runs the very same kernels
with the same arguments in the same order from C++, so the result is the Python loop's bit for bit
(tests/unit/test_decode_block.py compares both).

It allows it when (checked once per model, then once per forward):
- every product of every block is one quantized matrix the AVX2 kernel runs (no float weights, no
  unfused Q/K/V), the activation is SiLU or GELU (tanh), float32 on the CPU, the extension is built;
- the forward is an engine step (``StepPlan``) in which every row decodes one token with the paged
  attention op and no position bias, and every row is a generated row (``layers.quantized``'s
  roles: prompt rows take the exact float product, which this op does not do);
- torch.compile is not tracing (the compiled decode step traces the Python loop).
Anything else runs the Python loop, which stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.plan import StepPlan
from ..layers import quantized
from ..layers.elementwise import GATED_KINDS
from ..layers.kernels import elementwise_ops
from ..layers.quantized import QuantizedWeight
from ..layers.threads import PARALLEL_MIN_WORK, caller_threads, kernel_threads


@dataclass(frozen=True, slots=True)
class _Product:
    weight: QuantizedWeight
    bias: torch.Tensor | None


def _matrix(weight, bias: torch.Tensor | None) -> _Product | None:
    """A product the AVX2 kernel runs as one op, or None."""
    if not isinstance(weight, QuantizedWeight) or weight.transposed or weight.device.type != "cpu":
        return None
    return _Product(weight, bias)


def _block_products(layer) -> list[_Product] | None:
    """A block's products qkv, o, gate_up, down, or None when one is not a single quantized matrix."""
    fused = [layer.qkv.parts[0] if len(layer.qkv.parts) == 1 else (None, None),
             layer.gate_up.parts[0] if len(layer.gate_up.parts) == 1 else (None, None)]
    products = [_matrix(*fused[0]), _matrix(layer.o, layer.o_bias), _matrix(*fused[1]),
                _matrix(layer.down, layer.down_bias)]
    return None if any(p is None for p in products) else products


class FusedDecode:
    """Each block's packed arguments for ``decode_block`` (built once per model)."""

    def __init__(self, model, op, blocks: list[list[_Product]], activation: int):
        cfg = model.config
        self.op = op
        self.shapes = [(p.weight.inputs, p.weight.outputs) for p in blocks[0]]  # the same in every block
        self.weights = [
            [entry for p in products for entry in (p.weight.codes, p.weight.scale, p.weight.mins, p.bias)]
            + [layer.mlp_norm, next_norm]
            for layer, next_norm, products in zip(model.layers, model.next_norms, blocks)
        ]  # 18 per block: (codes, scale, mins, bias) x 4, the MLP norm, the next block's input norm
        self.product_ints = [(p.weight.bits, p.weight.group, p.weight.activation_bits, p.weight.outputs)
                             for p in blocks[0]]
        self.head_ints = [cfg.num_heads, cfg.num_kv_heads, activation]
        self.floats = [float(cfg.norm_eps), float(model.scale)]

    @classmethod
    def for_model(cls, model) -> "FusedDecode | None":
        """The packing, or None where a block cannot run as one op (see the module docstring)."""
        activation = GATED_KINDS.get(model.config.hidden_act)
        if activation is None or model.dtype != torch.float32 or not quantized.USE_KERNEL:
            return None
        blocks = [_block_products(layer) for layer in model.layers]
        if not blocks or any(b is None for b in blocks):
            return None
        if len({tuple((p.weight.inputs, p.weight.outputs, p.weight.bits, p.weight.group, p.weight.activation_bits)
                      for p in products) for products in blocks}) != 1:
            return None  # blocks of different shapes or formats (thread counts and ints are shared)
        ops = elementwise_ops()
        return None if ops is None else cls(model, ops.decode_block, blocks, activation)

    def step(self, cache, x: torch.Tensor) -> "_Step | None":
        """This forward's per-block runner, or None when the step must take the Python loop."""
        if (not isinstance(cache, StepPlan) or cache.score_bias is not None or x.shape[0] != 1 or not x.is_cpu
                or x.dtype != torch.float32 or torch.compiler.is_compiling()
                or (quantized.PROMPT_ROWS_EXACT and quantized.current_roles() is not None)):
            return None
        rows = x.shape[1]
        per_product = []
        for (inputs, outputs), ints in zip(self.shapes, self.product_ints):
            per_product += [*ints, kernel_threads(rows * inputs * outputs)]
        return _Step(self, cache, [caller_threads(), PARALLEL_MIN_WORK, *per_product])


class _Step:
    """One forward's calls: ``(index, x, h, cos, sin) -> (x, h)`` for a block, or None when the block's
    attention cannot take the paged op (the caller then runs it in Python)."""

    __slots__ = ("fused", "plan", "tail", "ints_by_window")

    def __init__(self, fused: FusedDecode, plan: StepPlan, tail: list[int]):
        self.fused = fused
        self.plan = plan
        self.tail = tail  # the ints after the window: threads, threshold, per-product ints
        self.ints_by_window: dict[int, list[int]] = {}

    def __call__(self, index: int, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        operands = self.plan.decode_operands(index)
        if operands is None:
            return None
        keys, values, slots, table, key_start, positions, window = operands
        fused, window = self.fused, window or 0
        ints = self.ints_by_window.get(window)
        if ints is None:
            ints = self.ints_by_window[window] = [*fused.head_ints, self.plan.cache.block_size, window, *self.tail]
        return fused.op(x, h, fused.weights[index], ints, fused.floats, cos, sin, keys, values, slots, table,
                        key_start, positions)
