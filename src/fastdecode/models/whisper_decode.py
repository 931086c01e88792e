"""Pure decode steps of Whisper's decoder: one op per layer (layers/decode_block.cpp's cross_decode_block).

A Whisper decode step is small: tiny.en's four decoder layers hold 8M weights and each row reads its
window's cross K/V, yet the Python loop body calls about 25 ops per layer (three LayerNorms, six
products, the two attentions, the residual adds, head splits), some 2-3 ms of dispatch per step on two
cores, as much as the products. When a step allows it, ``BartModel.decode`` (its ``fused_layers``) hands each layer to
``cross_decode_block``, which runs the very same ops with the same arguments in the same order from C++,
so the result is the Python loop's bit for bit (tests/speech/test_whisper_decode_block.py compares both).

It allows it when (checked once per model, then once per forward):
- the model is pre-LayerNorm with a GELU MLP (Whisper), float32 on the CPU, the extension built, and its
  kernel choice has the quantized kernels on; every product of every layer (Q/K/V fused, output, cross
  Q, cross output, up, down) is one matrix that a kernel of the extension runs for generated rows (as
  models/llama_decode.py's ``packed_product``);
- the forward is an engine step (a ``StepPlan``, engine/plan.py, with ``decode_operands``) in which every
  row decodes one token with the paged attention op, every row is a generated row, under the kernel
  choice the layers were packed for; and its cross-attention view is a step over encoded windows
  (engine/speech_source.py's ``EncodedStep``, its ``decode_sources``) whose every source the C++
  cross-attention serves;
- torch.compile is not tracing, autograd is off.
Anything else runs the Python loop, which stays the reference.
"""

from __future__ import annotations

import torch

from ..layers import ops
from ..layers.products import KernelChoice
from ..layers.threads import KERNEL_PARALLEL_MIN_WORK, kernel_threads
from .llama_decode import PackedProduct, packed_product, stack_operands

_NORMS = ("attn_norm", "cross_norm", "mlp_norm")


def _layer_products(layer, kernels: KernelChoice) -> list[PackedProduct] | None:
    """A layer's products qkv, o, cross_q, cross_o, up, down, or None when one is not a single kernel-run
    matrix."""
    if len(layer.qkv.parts) != 1:
        return None
    products = [packed_product(*layer.qkv.parts[0], kernels)]
    products += [packed_product(getattr(layer, name), getattr(layer, f"{name}_bias"), kernels)
                 for name in ("o", "cross_q", "cross_o", "up", "down")]
    return None if any(p is None for p in products) else products


class FusedCrossDecode:
    """Each decoder layer's packed arguments for ``cross_decode_block`` (built once per model)."""

    def __init__(self, model, layers: list[list[PackedProduct]]):
        cfg = model.config
        self.op = ops.cross_decode_block
        self.kernels = model.kernels  # the choice the layers are packed for
        # 30 per layer: 4 entries per product, then each norm's weight and bias (decode_block.cpp's order)
        self.weights = [[entry for p in products for entry in p.entries]
                        + [t for name in _NORMS for t in (getattr(layer, name), getattr(layer, f"{name}_bias"))]
                        for layer, products in zip(model.decoder.layers, layers)]
        self.shapes = [[(p.ints, p.shape) for p in products] for products in layers]
        self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.floats = [float(cfg.norm_eps), float(model.scale)]
        # (rows, threads) -> (per layer its products' ints, every layer's in order): ``_product_ints``
        self._ints: dict[tuple[int, int], tuple[list[list[int]], list[int]]] = {}
        # every layer at once (cross_decode_stack.cpp), for steps whose layers share one attention kind and window
        self.stack = ops.cross_decode_stack_holder(self.weights)
        self.stack_op = ops.cross_decode_stack

    @classmethod
    def for_model(cls, model) -> FusedCrossDecode | None:
        """The packing, or None where a layer cannot run as one op (see the module docstring)."""
        cfg = model.config
        if (not cfg.pre_norm or cfg.hidden_act != "gelu" or model.dtype != torch.float32
                or model.device.type != "cpu" or not model.kernels.quantized_kernels):
            return None
        layers = [_layer_products(layer, model.kernels) for layer in model.decoder.layers]
        if not layers or any(products is None for products in layers):
            return None
        return cls(model, layers) if ops.available() else None

    def step(self, plan, cross, x: torch.Tensor) -> _Step | None:
        """This forward's per-layer runner, or None when the step must take the Python loop."""
        if (not hasattr(plan, "decode_operands") or not hasattr(cross, "decode_sources")
                or plan.score_bias is not None or x.shape[0] != 1 or not x.is_cpu or x.dtype != torch.float32
                or torch.compiler.is_compiling() or torch.is_grad_enabled() or plan.products.roles is not None
                or plan.products.kernels != self.kernels):
            return None
        rows, budget = x.shape[1], plan.products.threads
        sources = cross.decode_sources(rows, self.head_dim)  # [(first row, rows, EncodedSources)] or None
        if sources is None:
            return None
        width = 2 * self.heads * self.head_dim  # multiply-adds per query and key, scores and sums
        source_ints = [i for first, count, source in sources
                       for i in (first, count, kernel_threads(width * count * source.keys[0].shape[2], budget))]
        return _Step(self, plan, budget, *self._product_ints(rows, budget), source_ints,
                     [source for _, _, source in sources])

    def _product_ints(self, rows: int, budget: int) -> tuple[list[list[int]], list[int]]:
        """Per layer, its products' 5 ints each (the last: the kernel threads for ``rows`` rows), and every
        layer's in layer order (the stack op's), kept per (rows, budget): a step packs them once, not per layer."""
        key = (rows, budget)
        if key not in self._ints:
            if len(self._ints) > 64:
                self._ints.clear()
            layers = [[i for product_ints, (inputs, outputs) in layer
                       for i in (*product_ints, kernel_threads(rows * inputs * outputs, budget))]
                      for layer in self.shapes]
            self._ints[key] = (layers, [i for layer in layers for i in layer])
        return self._ints[key]


class _Step:
    """One forward's calls: ``(index, x) -> x`` for a layer, or None when the layer's self-attention
    cannot take the paged op (the caller then runs it in Python); ``every_layer(x) -> x`` for all layers
    at once, or None."""

    __slots__ = ("fused", "plan", "products", "source_ints", "sources", "stack_products", "threads")

    def __init__(self, fused: FusedCrossDecode, plan, threads: int, products: list[list[int]],
                 stack_products: list[int], source_ints: list[int], sources: list):
        self.fused, self.plan, self.threads = fused, plan, threads
        self.products = products  # per layer: 5 ints per product
        self.stack_products = stack_products  # every layer's, in layer order
        self.source_ints = source_ints  # per source: first row, rows, threads
        self.sources = sources  # EncodedSources of one window each

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        operands = self.plan.decode_operands(index)
        if operands is None:
            return None
        keys, values, slots, table, key_start, positions, window = operands
        fused = self.fused
        ints = [fused.heads, self.plan.cache.block_size, window or 0, self.threads, KERNEL_PARALLEL_MIN_WORK,
                *self.products[index], *self.source_ints]
        return fused.op(x, fused.weights[index], ints, fused.floats, keys, values, slots, table, key_start, positions,
                        [s.keys[index] for s in self.sources], [s.values[index] for s in self.sources],
                        [s.lengths for s in self.sources])

    def every_layer(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every layer in one op (cross_decode_stack.cpp: the per-layer calls' results bit for bit) -> x, or
        None where the layers differ in attention kind or window, or the attention cannot take the paged op."""
        plan, fused, sources = self.plan, self.fused, self.sources
        cache = plan.cache
        operands = stack_operands(plan)
        if operands is None:
            return None
        _, _, slots, table, key_start, positions, window = operands
        ints = [fused.heads, cache.block_size, window or 0, self.threads, KERNEL_PARALLEL_MIN_WORK,
                *self.stack_products, *self.source_ints]
        if len(sources) == 1:  # one window: its per-layer lists are the layer-major lists
            source_keys, source_values = sources[0].keys, sources[0].values
        else:
            source_keys = [s.keys[index] for index in range(len(fused.weights)) for s in sources]
            source_values = [s.values[index] for index in range(len(fused.weights)) for s in sources]
        return fused.stack_op(fused.stack, x, ints, fused.floats, cache.layer_keys, cache.layer_values, slots, table,
                              key_start, positions, source_keys, source_values, [s.lengths for s in sources])
