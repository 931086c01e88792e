"""``load(..., quantize="int8" | "int4")`` (and ``from_hf``'s): a float checkpoint's matrices quantized once at load.

Quantized: every linear weight (canonical [in, out], quantized as its [out, in] rows) and the token
embedding tables ([V, C], one row per token; a tied LM head shares the embedding's quantized table).
Kept float: norms, biases, position tables (learned, T5's relative buckets), anything 1-D, and a
matrix whose input size is not a multiple of the group (32: laid out as ``load`` lays it out, so an in-memory
model's shared view is copied); quantized GGUF blocks stay as they are.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..errors import InvalidOptionError
from ..layers.quantized import (QuantizedWeight, for_logits, in_mlp, int8_prompt_rows, keeps_rows_layout, quantize_matrix,
                                tiled)

log = logging.getLogger("fastdecode")
QUANTIZE_CHOICES = ("int8", "int4", "dequantize")
_KEEP_FLOAT = ("pos_embed", "relative_bias", "norm")


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise InvalidOptionError(f"quantize must be None or one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")


def check_gguf_quantize(path, quantize: str | None) -> None:
    """``quantize="int8" | "int4"`` on a GGUF whose matrices are already quantized blocks is refused
    (read from the header only, before loading): those blocks run natively and would stay as they
    are, so the option would change nothing but the few float matrices."""
    if quantize not in ("int8", "int4"):
        return
    from .gguf_file import GGUFFile

    matrices = [info.type_name for info in GGUFFile(path).tensors.values() if len(info.shape) == 2]
    quantized = sorted({t for t in matrices if t not in FLOAT_GGUF_TYPES})
    if not quantized:
        return
    counts = ", ".join(f"{matrices.count(t)} {t}" for t in sorted(set(matrices)))
    raise InvalidOptionError(
        f"{Path(path).name} is already quantized: its {len(matrices)} matrices are {counts}; quantize={quantize!r} "
        f"would leave the {', '.join(quantized)} blocks as they are (they run natively) and change nothing that "
        "matters. Leave quantize out to run the file's blocks, use quantize='dequantize' to decode them to the "
        f"dtype, or give a float (F16 / BF16 / F32) GGUF or a Hugging Face folder to quantize to {quantize}")


def apply_quantize(checkpoint, quantize: str | None, encoder_decoder_int8: bool = True):
    """``checkpoint`` with its weights as ``quantize`` asks (``load``'s and ``from_hf``'s last step): float
    matrices quantized for "int8" / "int4" (encoder-decoder models then, with ``encoder_decoder_int8``, on
    int8 activations everywhere, as CTranslate2 runs them: the logits layer and the prompt rows, encoder
    sources, included; False: as decoder-only models, which tests compare), and a quantized LM head, a
    GGUF's included, on float32 activations otherwise. (Callers check ``quantize`` first, before loading
    anything.)"""
    if quantize in ("int8", "int4"):
        checkpoint.weights = quantize_weights(checkpoint.weights, quantize)
    if quantize in ("int8", "int4") and checkpoint.family.is_encoder_decoder and encoder_decoder_int8:
        checkpoint.weights = int8_everywhere(checkpoint.weights)
    else:
        checkpoint.weights = logits_layer_precise(checkpoint.weights)
    checkpoint.weights = mlp_products_marked(checkpoint.weights)
    return checkpoint


MLP_PRODUCTS = ("gate", "up", "down", "gate_up")  # the canonical names of a block's MLP matrices, every family


def mlp_products_marked(weights: dict[str, torch.Tensor | QuantizedWeight]) -> dict:
    """Quantized MLP matrices (canonical ``....{gate,up,down,gate_up}.weight``) marked ``in_mlp``: the
    default kernel choice (``prompt_rows="int8-mlp"``) runs their prompt rows on int8."""
    def marked(name: str, weight):
        is_mlp = name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in MLP_PRODUCTS
        return in_mlp(weight) if is_mlp and isinstance(weight, QuantizedWeight) else weight

    return {name: marked(name, weight) for name, weight in weights.items()}


def logits_layer_precise(weights: dict[str, torch.Tensor | QuantizedWeight]) -> dict:
    """A quantized LM head runs its decode products on float32 activations (``quantized.for_logits``);
    other matrices, the embedding view of a tied head included, are unchanged."""
    head = weights.get("lm_head.weight")
    if isinstance(head, QuantizedWeight):
        weights = {**weights, "lm_head.weight": for_logits(head)}
    return weights


def int8_everywhere(weights: dict[str, torch.Tensor | QuantizedWeight]) -> dict:
    """Every quantized matrix on int8 activations for every row (``quantized.int8_prompt_rows``), the LM
    head included and moved to the tiled layout (its int8 kernel: 1.5x the float-activation one at 32 beam
    rows, bart-base's 50265 x 768 head), with the tables that share its codes (a tied embedding: lookups
    gather from that layout, one copy). For encoder-decoder models quantized at load."""
    head = weights.get("lm_head.weight")
    tiled_head = tiled(head) if isinstance(head, QuantizedWeight) else None
    done: dict[int, QuantizedWeight] = {}  # id of a table -> its conversion: names sharing a table still share one

    def converted(weight):
        if not isinstance(weight, QuantizedWeight):
            return weight
        if id(weight) not in done:
            new = weight
            if tiled_head is not None and weight.codes is head.codes:
                new = dataclasses.replace(weight, codes=tiled_head.codes, scale=tiled_head.scale, mins=tiled_head.mins,
                                          outputs=tiled_head.outputs)
            done[id(weight)] = int8_prompt_rows(new)
        return done[id(weight)]

    return {name: converted(weight) for name, weight in weights.items()}


def _is_embedding(name: str) -> bool:
    return name.endswith("embed.weight")  # embed / encoder_embed / decoder_embed (not pos_embed: kept float)


def quantize_weights(weights: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Canonical float weights -> the same dict with its matrices quantized (see the module docstring)."""
    done: list[tuple[torch.Tensor, QuantizedWeight]] = []  # [out, in] float matrix -> its quantized form
    skipped = []

    def quantized(matrix: torch.Tensor, name: str) -> QuantizedWeight:
        for source, result in done:  # tied views (same memory) and equal copies (aliases) share one table
            if source.shape == matrix.shape and (
                (source.data_ptr() == matrix.data_ptr() and source.stride() == matrix.stride())
                or torch.equal(source, matrix)
            ):
                return result
        result = quantize_matrix(matrix, kind, tile=not keeps_rows_layout(name)).to(dtype=matrix.dtype)
        done.append((matrix, result))
        return result

    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    # embeddings first, so that a tied LM head finds the embedding's table
    for name in sorted(weights, key=lambda n: not _is_embedding(n)):
        tensor = weights[name]
        if (not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not name.endswith(".weight")
                or any(part in name for part in _KEEP_FLOAT)):
            out[name] = tensor
        elif _is_embedding(name):  # [V, C]: rows are tokens
            out[name] = tensor if tensor.shape[1] % 32 else quantized(tensor, name)
        elif tensor.shape[0] % 32:  # [in, out] with `in` not a multiple of the group
            skipped.append(name)
            # kept float in load's layout ([in, out] contiguous; from_hf's shared [out, in] view copied), so
            # that it takes the same product, with the same bits, whichever way the model came
            out[name] = tensor.contiguous()  # [in, out]
        else:
            out[name] = quantized(tensor.t(), name).t()  # rows of [out, in], seen as [in, out]
    if skipped:
        log.info("fastdecode: kept float (input size not a multiple of 32): %s", ", ".join(skipped))
    return {name: out[name] for name in weights}
