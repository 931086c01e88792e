"""Fused projections: products that read the same input (Q, K, V; gate, up) as one matrix.

A decode step at batch 1 is a chain of small products, and each one costs a fixed amount of
dispatch around its kernel; running Q, K and V as one product of their concatenated rows (and
gate with up) removes two of every three calls. The weights are concatenated once, at model
construction, and the checkpoint's own entries become views of the fused matrix, so memory holds
one copy of every weight (``Generator.checkpoint.weights`` and ``inspect`` still see each
projection under its own name).

What fuses: float matrices the loader owns (contiguous canonical [in, out] buffers; an in-memory
HF model's shared weights are not copied, so they stay separate), and quantized matrices of one
format (same code type, bits, group and scale dtype: e.g. Q and K, gate and up of a GGUF file;
V and down are often of another type and then run alone). Each output element is the same dot
product as before, so results match the separate products up to the GEMM's summation order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import ops
from .elementwise import GATED_KINDS, gated
from .linear import linear
from .products import Products
from .quantized import TILE, QuantizedWeight, tiled_rows
from .threads import kernel_threads

Weight = torch.Tensor | QuantizedWeight


@dataclass(frozen=True, slots=True, eq=False)
class FusedProjection:
    """Products sharing one input, fused where their formats allow: ``parts`` [(weight [out, in],
    bias [out] or None)]; ``sizes``: each projection's output width, in order."""

    parts: tuple[tuple[Weight, torch.Tensor | None], ...]
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor, products: Products) -> torch.Tensor:
        """x [..., in] -> every projection's output, concatenated [..., sum(sizes)] (``products``: the
        forward's row roles and thread budget, as ``linear`` takes them)."""
        outputs = [linear(x, weight, bias, products=products) for weight, bias in self.parts]
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)

    def gated(self, x: torch.Tensor, activation: str, products: Products) -> torch.Tensor:
        """act(gate) * up [..., I] of this projection's two outputs [gate | up] (activation: a ``GATED_KINDS``
        name): ``gated(self(x, products), activation)``'s bits, in one op where the product would run
        ``ops.tiled_gemm`` (a tiled weight's int8 rows: layers/qlanes_gated.cpp)."""
        weight, bias = self.parts[0] if len(self.parts) == 1 else (None, None)
        kind = GATED_KINDS.get(activation)
        if isinstance(weight, QuantizedWeight) and bias is None and kind is not None and x.dtype == torch.float32:
            rows = x.reshape(-1, x.shape[-1])  # [M, K]
            if _takes_tiled_gemm(rows, weight, products):
                budget = kernel_threads(rows.shape[0] * weight.inputs * weight.outputs, products.threads)
                out = ops.tiled_gated_gemm(rows.contiguous(), weight.codes, weight.scale, weight.mins, weight.bits,
                                           weight.outputs, budget, kind)  # [M, I]
                return out.view(*x.shape[:-1], weight.outputs // 2)  # [..., I]
        return gated(self(x, products), activation, threads=products.threads)

    def split(self, x: torch.Tensor, products: Products) -> tuple[torch.Tensor, ...]:
        """x [..., in] -> each projection's output [..., size] (views of one product where fused)."""
        return self(x, products).split(self.sizes, dim=-1)


def _takes_tiled_gemm(rows: torch.Tensor, weight: QuantizedWeight, products: Products) -> bool:
    """Whether quantized_linear runs every one of rows [M, K] float32 x weight (no bias) on ``ops.tiled_gemm``:
    the kernels on, its kernel product on tiled rows (``tiled_rows``; a tiled weight has no prompt kernel of its
    own, so its int8 prompt rows take that product too), and no row routed to the exact products."""
    choice = products.kernels
    if not (choice.quantized_kernels and rows.is_cpu and ops.available() and not weight.transposed):
        return False
    exact_prompts = weight.exact_prompt_rows and choice.exact_prompts(weight.in_mlp)
    return tiled_rows(rows.shape[0], weight) and (not exact_prompts or products.roles is None)


def _format(weight: Weight) -> tuple | None:
    """What must agree for two matrices to share one product (None: never fused)."""
    if isinstance(weight, QuantizedWeight):
        if weight.is_tiled and weight.outputs % TILE:  # a padded tail tile cannot sit inside a fused matrix
            return None
        return ("q", weight.kind, weight.bits, weight.group, weight.scale.dtype, weight.mins is None,
                weight.device, weight.dtype, weight.transposed, weight.is_tiled)
    if weight.dim() == 2 and weight.is_contiguous():  # a loader-owned [in, out] buffer
        return ("dense", weight.dtype, weight.device, weight.shape[0])
    return None


def concat_outputs(weights: list[Weight]) -> tuple[Weight, list[Weight]]:
    """Canonical [in, out_i] weights of one format -> (the fused [in, sum(out_i)] weight, a view of it
    per input weight). Quantized ones concatenate their stored rows (codes, scales, mins)."""
    if isinstance(weights[0], QuantizedWeight):
        def cat(field: str) -> torch.Tensor:  # stored [out, ...] or [out tiles, ...]: outputs first
            return cat_rows([getattr(w, field) for w in weights])

        fused = dataclasses.replace(weights[0], codes=cat("codes"), scale=cat("scale"),
                                    mins=None if weights[0].mins is None else cat("mins"),
                                    outputs=sum(w.outputs for w in weights))
        views, row = [], 0
        for w in weights:
            part = fused.row_range(row, row + w.outputs)
            views.append(dataclasses.replace(w, codes=part.codes, scale=part.scale, mins=part.mins))
            row += w.outputs
        return fused, views
    fused = torch.cat(weights, dim=1)  # [in, sum(out)]
    return fused, list(fused.split([w.shape[1] for w in weights], dim=1))


def cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors, dim=0)``; a view where they already lie one after another in one storage
    (weights mapped from the cache of a model fused before: loading/weight_cache.py), else a copy."""
    first = tensors[0]
    offset = first.storage_offset()
    for tensor in tensors:
        if (tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or tensor.dtype != first.dtype or not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:]
                or tensor.storage_offset() != offset):
            return torch.cat(tensors, dim=0)
        offset += tensor.numel()
    rows = sum(tensor.shape[0] for tensor in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())  # [sum rows, ...]


def fuse_projections(weights: dict[str, Weight], names: list[str]) -> FusedProjection:
    """The projections ``names`` (canonical prefixes such as "layers.3.q": their ".weight" [in, out]
    and optional ".bias" [out]) as one ``FusedProjection``: consecutive ones of one format fused.

    ``weights`` (the checkpoint's dict) is updated in place: each fused projection's entry becomes
    a view of the fused matrix, so the separate matrices are freed and no weight is held twice."""
    groups: list[list[str]] = []
    for name in names:
        key = _format(weights[f"{name}.weight"])
        if groups and key is not None and key == _format(weights[f"{groups[-1][-1]}.weight"]):
            groups[-1].append(name)
        else:
            groups.append([name])
    parts = []
    for group in groups:
        matrices = [weights[f"{name}.weight"] for name in group]
        biases = [weights.get(f"{name}.bias") for name in group]
        if len(group) > 1:
            fused, views = concat_outputs(matrices)
            for name, view in zip(group, views):
                weights[f"{name}.weight"] = view
            matrices = [fused]
            biases = [None if all(b is None for b in biases) else _fuse_biases(weights, group, biases, views)]
        parts.append((matrices[0].t(), biases[0]))  # [in, out] buffer seen as [out, in] for linear()
    sizes = tuple(weights[f"{name}.weight"].shape[1] for name in names)
    return FusedProjection(tuple(parts), sizes)


def _fuse_biases(weights: dict[str, Weight], group: list[str], biases: list, views: list[Weight]) -> torch.Tensor:
    """The fused product's bias [sum(out)] (zeros for a projection without one); the checkpoint's
    bias entries become views of it."""
    known = next(b for b in biases if b is not None)
    fused = cat_rows([b if b is not None else torch.zeros(m.shape[1], dtype=known.dtype, device=known.device)
                      for b, m in zip(biases, views)])
    for name, bias, part in zip(group, biases, fused.split([m.shape[1] for m in views])):
        if bias is not None:
            weights[f"{name}.bias"] = part
    return fused
