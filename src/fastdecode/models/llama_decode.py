"""Pure decode steps of a Llama-family model: one op per block (layers/decode_block.cpp).

A batch-1 decode step of SmolLM2-135M is 30 blocks of ten small ops; dispatching them from Python
costs about 150 us per block, as much as the products themselves on two cores. When a step allows
it, ``LlamaModel.forward`` hands each block to ``decode_block``, which runs the very same kernels
with the same arguments in the same order from C++, so the result is the Python loop's bit for bit
(tests/unit/test_decode_block.py compares both).

It allows it when (checked once per model, then once per forward):
- the model's kernel choice (``model.kernels``: layers/products.py) has the quantized kernels on, and
  every product of every block is one matrix that a kernel of the extension runs for generated rows:
  quantized (``quantized_linear``'s int8-activation kernel) or float32 on a contiguous [in, out]
  buffer (``linear``'s float_matmul); Q/K/V fused into one matrix or two (a GGUF's Q + K beside a V of
  another type: two products, concatenated as ``FusedProjection`` does), gate/up into one; the
  activation is SiLU or GELU (tanh); float32 on the CPU, the extension built. Blocks may differ in
  their formats (Q4_K_M files mix Q4_K and Q6_K V and down matrices): each block gets its own ints;
- the forward is an engine step (a ``StepPlan``, engine/plan.py: the view with ``decode_operands``,
  read by duck typing so that models never import the engine) in which every row decodes one token
  with the paged attention op and no position bias, and every row is a generated row (the plan's
  ``Products``: prompt rows take the exact products, which this op does not do), under the kernel
  choice the blocks were packed for;
- torch.compile is not tracing (the compiled decode step traces the Python loop).
Anything else runs the Python loop, which stays the reference.

A step of one row whose logits are wanted is then ONE op (``whole_step``: decode_stack.cpp's
decode_stack_logits) where the embedding table is quantized in the rows layout that the extension's
``dequantize`` decodes (as ``embed`` looks rows up) and the logits layer is quantized (``linear``'s
kernel): embedding row, first norm, every block, logits, the forward's bits (tests/unit/test_decode_step_logits.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import ops
from ..layers.elementwise import GATED_KINDS
from ..layers.linear import float_kernel_serves, kernel_bias
from ..layers.ops import BlockProduct, DecodeBlockArgs
from ..layers.products import KernelChoice
from ..layers.quantized import DECODED_ROWS, QuantizedWeight
from ..layers.threads import KERNEL_PARALLEL_MIN_WORK, kernel_threads


@dataclass(frozen=True, slots=True)
class PackedProduct:
    """One product's op arguments: its 4 weight entries, its ints (bits, group, activation bits, outputs;
    bits 0: float32, then float_matmul's in-place row limits, ``KernelChoice.in_place_rows``, for group and
    activation bits) and its (inputs, outputs)."""

    entries: tuple
    ints: tuple[int, int, int, int]
    shape: tuple[int, int]


def packed_product(weight, bias: torch.Tensor | None, kernels: KernelChoice) -> PackedProduct | None:
    """A product one kernel runs, as the Python loop would run it for generated rows, or None: a
    quantized weight (``quantized_linear``'s kernel), or a float32 [out, in] view of a contiguous
    [in, out] buffer (``linear``'s float_matmul, where the extension has it)."""
    if isinstance(weight, QuantizedWeight):
        if weight.transposed or weight.device.type != "cpu":
            return None
        return PackedProduct((weight.codes, weight.scale, weight.mins, bias),
                             (weight.bits, weight.group, weight.activation_bits, weight.outputs),
                             (weight.inputs, weight.outputs))
    if not isinstance(weight, torch.Tensor) or not float_kernel_serves(weight, kernels):
        return None
    N, K = weight.shape
    return PackedProduct((weight.t(), None, None, kernel_bias(bias)), (0, *kernels.in_place_rows, N), (K, N))


def _block_products(layer, kernels: KernelChoice) -> list[PackedProduct] | None:
    """A block's products qkv, o, gate_up, down (then the second qkv product where Q/K/V are two fused
    matrices), or None when one is not a single kernel-run matrix."""
    qkv, gate_up = layer.qkv.parts, layer.gate_up.parts
    if len(qkv) > 2 or len(gate_up) != 1:
        return None
    products = [packed_product(*qkv[0], kernels), packed_product(layer.o, layer.o_bias, kernels),
                packed_product(*gate_up[0], kernels), packed_product(layer.down, layer.down_bias, kernels),
                *(packed_product(*part, kernels) for part in qkv[1:])]
    return None if any(p is None for p in products) else products


def step_ends(model) -> tuple[list, tuple[int, int], PackedProduct] | None:
    """The whole step's ends (decode_stack.cpp's ``set_ends``: the embedding table's codes, scale and mins, the
    first block's input norm, the logits layer's 4 entries), the table's (bits, group) and the logits layer's
    packing; or None where ``embed`` or ``head`` would not run the ops the whole step runs."""
    table, head, cfg = model.embed, model.lm_head, model.config
    if (not isinstance(table, QuantizedWeight) or table.is_tiled or table.device.type != "cpu"
            or (table.bits, table.group) not in DECODED_ROWS or table.dtype != torch.float32
            or not isinstance(head, QuantizedWeight) or cfg.embedding_multiplier != 1.0 or cfg.logits_divisor != 1.0
            or any(rope is not model.rope for rope in model.layer_ropes)):
        return None
    packed = packed_product(head, None, model.kernels)
    if packed is None:
        return None
    return [table.codes, table.scale, table.mins, model.layers[0].attn_norm, *packed.entries], \
        (table.bits, table.group), packed


def stack_operands(plan) -> tuple | None:
    """A pure decode step's attention operands (``decode_operands`` of the first layer), when every layer
    shares one attention kind and window, so that one op can run every block; else None."""
    if len(set(plan.cache.layer_windows)) != 1 or len(set(plan.windows)) != 1:
        return None
    return plan.decode_operands(0)


class FusedDecode:
    """Each block's packed arguments for ``decode_block`` (built once per model)."""

    def __init__(self, model, blocks: list[list[PackedProduct]], activation: int):
        cfg = model.config
        self.op = ops.decode_block  # (x, h, weights, DecodeBlockArgs, ...) -> (x, h)
        self.kernels = model.kernels  # the choice the blocks are packed for
        # 18 or 22 per block: 4 entries per product, the MLP norm, the next block's input norm, then the
        # second qkv product's 4 where the block has one (decode_block.cpp's order)
        self.weights = [
            [entry for p in products[:4] for entry in p.entries] + [layer.mlp_norm, next_norm]
            + [entry for p in products[4:] for entry in p.entries]
            for layer, next_norm, products in zip(model.layers, model.next_norms, blocks)
        ]
        # the blocks' kinds: each distinct list of (ints, (inputs, outputs)) per product, and each block's kind
        signatures = [tuple((p.ints, p.shape) for p in products) for products in blocks]
        self.kinds = list(dict.fromkeys(signatures))
        self.block_kinds = [self.kinds.index(signature) for signature in signatures]
        self.heads = (cfg.num_heads, cfg.num_kv_heads, activation)
        self.norm_eps, self.scale = float(cfg.norm_eps), float(model.scale)
        # every block at once (decode_stack.cpp), for steps whose layers share one attention kind and window
        self.stack = ops.decode_stack_holder(list(zip(self.weights, self.block_kinds)))
        self.stack_op = ops.decode_stack
        # the whole step in one op (decode_stack_logits), where the table and the logits layer allow it
        ends = step_ends(model)
        self.table_ints, self.head = (None, None) if ends is None else ends[1:]
        if ends is not None:
            self.stack.set_ends(ends[0])
        self.rope = model.rope
        # by (rows, threads, block size, window): each kind's scalars, and decode_stack's (ints, floats)
        self._scalars: dict[tuple[int, int, int, int], tuple[list[DecodeBlockArgs], tuple[list[int], list[float]]]] = {}

    def _scalars_for(self, rows: int, threads: int, block_size: int, window: int):
        """(each kind's ``decode_block`` scalars, ``decode_stack``'s ints and floats) for a forward of ``rows``
        rows under a thread budget, the cache's block size and a window (0: none); made once per combination."""
        key = (rows, threads, block_size, window)
        scalars = self._scalars.get(key)
        if scalars is None:
            args = [DecodeBlockArgs(*self.heads, block_size=block_size, window=window, threads=threads,
                                    attention_min_work=KERNEL_PARALLEL_MIN_WORK, norm_eps=self.norm_eps,
                                    scale=self.scale,
                                    products=tuple(BlockProduct(*ints, kernel_threads(rows * inputs * outputs, threads))
                                                   for ints, (inputs, outputs) in kind))
                    for kind in self.kinds]
            stack = ([i for kind_args in args for i in kind_args.ints], args[0].floats)  # kinds' ints in kind order
            scalars = self._scalars[key] = (args, stack)
        return scalars

    def block_args(self, rows: int, threads: int, block_size: int, window: int) -> list[DecodeBlockArgs]:
        """Each kind's ``decode_block`` scalars (``_scalars_for``)."""
        return self._scalars_for(rows, threads, block_size, window)[0]

    def stack_scalars(self, rows: int, threads: int, block_size: int, window: int) -> tuple[list[int], list[float]]:
        """``decode_stack``'s ints (every kind's ``decode_block`` ints, in kind order) and floats."""
        return self._scalars_for(rows, threads, block_size, window)[1]

    def end_ints(self, rows: int, threads: int) -> list[int]:
        """decode_stack_logits' ints: the table's (bits, group), the logits layer's 5 product ints."""
        inputs, outputs = self.head.shape
        return [*self.table_ints, *self.head.ints, kernel_threads(rows * inputs * outputs, threads)]

    @property
    def runs_quantized_products(self) -> bool:
        """Whether some block's products run on the int8-activation kernels (ints[0]: a product's bits)."""
        return any(ints[0] for kind in self.kinds for ints, _ in kind)

    @classmethod
    def for_model(cls, model) -> "FusedDecode | None":
        """The packing, or None where a block cannot run as one op (see the module docstring)."""
        activation = GATED_KINDS.get(model.config.hidden_act)
        if activation is None or model.dtype != torch.float32 or not model.kernels.quantized_kernels:
            return None
        blocks = [_block_products(layer, model.kernels) for layer in model.layers]
        if not blocks or any(b is None for b in blocks):
            return None
        return cls(model, blocks, activation) if ops.available() else None

    def step(self, cache, x: torch.Tensor) -> "_Step | None":
        """This forward's per-block runner, or None when the step must take the Python loop."""
        return self._step(cache, x) if x.dtype == torch.float32 else None

    def whole_step(self, cache, tokens: torch.Tensor, positions: torch.Tensor,
                   logits_at: torch.Tensor | None) -> torch.Tensor | None:
        """A forward of one token (tokens, positions [1, 1]) whose logits are wanted (``logits_at`` [1]) in one
        op -> logits [1, 1, V]; or None (the forward then runs as it would without it)."""
        if self.head is None or tokens.shape != (1, 1) or logits_at is None or logits_at.shape != (1,):
            return None
        step = self._step(cache, tokens)
        return None if step is None else step.logits(tokens, *self.rope.tables(positions, torch.float32))

    def _step(self, cache, rows: torch.Tensor) -> _Step | None:
        """``step`` for rows [B, ...] (the forward's x, or its tokens)."""
        if (not hasattr(cache, "decode_operands") or cache.score_bias is not None or rows.shape[0] != 1
                or not rows.is_cpu or torch.compiler.is_compiling() or torch.is_grad_enabled()
                or cache.products.roles is not None or cache.products.kernels != self.kernels):
            return None
        return _Step(self, cache, cache.products.threads)


class _Step:
    """One forward's calls: ``(index, x, h, cos, sin) -> (x, h)`` for a block, or None when the block's
    attention cannot take the paged op (the caller then runs it in Python); ``every_block(x, h, cos, sin)``
    for all blocks at once, or None."""

    __slots__ = ("fused", "plan", "threads")

    def __init__(self, fused: FusedDecode, plan, threads: int):
        self.fused = fused
        self.plan = plan
        self.threads = threads  # the forward's thread budget (each product's threads: ``block_args``)

    def __call__(self, index: int, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        operands = self.plan.decode_operands(index)
        if operands is None:
            return None
        keys, values, slots, table, key_start, positions, window = operands
        fused = self.fused
        args = fused.block_args(x.shape[1], self.threads, self.plan.cache.block_size, window or 0)[fused.block_kinds[index]]
        return fused.op(x, h, fused.weights[index], args, cos, sin, keys, values, slots, table, key_start, positions)

    def _stack_args(self, rows: int) -> tuple | None:
        """decode_stack's (ints, floats) and its step tensors after cos, sin (every layer's keys and values, slots,
        table, key_start, positions) for ``rows`` rows; None where the layers differ in attention kind or window,
        or the attention cannot take the paged op."""
        operands = stack_operands(self.plan)
        if operands is None:
            return None
        _, _, slots, table, key_start, positions, window = operands
        cache = self.plan.cache
        ints, floats = self.fused.stack_scalars(rows, self.threads, cache.block_size, window or 0)
        return ints, floats, (cache.layer_keys, cache.layer_values, slots, table, key_start, positions)

    def every_block(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Every block in one op (decode_stack.cpp: the per-block calls' results bit for bit) -> (x, h), or
        None as ``_stack_args``."""
        args = self._stack_args(x.shape[1])
        if args is None:
            return None
        ints, floats, step = args
        return self.fused.stack_op(self.fused.stack, x, h, ints, floats, cos, sin, *step)

    def logits(self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """The whole step (decode_stack_logits): tokens [1, N] -> logits [1, N, V], or None as ``_stack_args``."""
        N = tokens.shape[1]
        args = self._stack_args(N)
        if args is None:
            return None
        ints, floats, step = args
        return ops.decode_stack_logits(self.fused.stack, tokens.view(N), self.fused.end_ints(N, self.threads), ints,
                                       floats, cos, sin, *step)  # tokens [1, N] -> [N]
