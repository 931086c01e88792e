"""The compiled kernels' ops: the only module that touches ``torch.ops.fastdecode_kernels`` (and
oneDNN's ``torch.ops.mkldnn`` GEMM), one typed wrapper per op, as vLLM's ``_custom_ops.py``.

The extension (every ``layers/*.cpp``) is built by ``layers/kernels.py`` and loaded here on first
use. ``available()`` is False (logged once, with why) where it cannot be had: no AVX2/FMA/F16C, no
compiler; callers then take their PyTorch path. Every op has a fake (meta) kernel (``fake_kernels.py``), so
``torch.compile(fullgraph=True)`` traces through the wrappers. Each wrapper calls the op's
``default`` overload (about 5.5 us against 9.4 us through the overload packet).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .fake_kernels import register_fake
from .kernels import build, cpu_has_avx2, library_path

log = logging.getLogger("fastdecode")
Tensor = torch.Tensor
_LOADED: dict[str, object] = {}  # "ops" -> the loaded ops (or None): a dict torch.compile reads


def _ops():
    if "ops" not in _LOADED:
        _LOADED["ops"] = _load_ops()
    return _LOADED["ops"]


def available() -> bool:
    """Whether the extension is built and loaded (else every caller takes its PyTorch path)."""
    return _ops() is not None


# -- quantized and float products (qmatmul.cpp, exact_matmul.cpp, fmatmul.cpp) ------------------
def qmatmul(x: Tensor, codes: Tensor, scale: Tensor, mins: Tensor | None, bits: int, group: int, threads: int,
            activation_bits: int = 8, outputs: int = -1, bias: Tensor | None = None) -> Tensor:
    """Generated rows x [M, K] float32 times a quantized weight (+ bias) -> [M, N]: activations rounded
    to int8 per 32 inputs (``activation_bits`` 8) or kept float32 (32)."""
    return _ops().qmatmul(x, codes, scale, mins, bits, group, threads, activation_bits, outputs, bias)


def exact_qmatmul(x: Tensor, codes: Tensor, scale: Tensor, mins: Tensor | None, bits: int, group: int,
                  threads: int, outputs: int = -1) -> Tensor:
    """Prompt rows x [M, K] times a quantized weight's exact float32 values -> [M, N]."""
    return _ops().exact_qmatmul(x, codes, scale, mins, bits, group, threads, outputs)


def prompt_qmatmul(x: Tensor, codes: Tensor, scale: Tensor, threads: int, bias: Tensor | None = None) -> Tensor:
    """Int8-rounded prompt rows x [M, K] float32 times rows-layout 8-bit codes in groups of 16 (Q6_K,
    layers/qprompt.cpp) (+ bias: float32 [N], the bits of adding it after) -> [M, N]: each row the same
    bits at any row count."""
    return _ops().prompt_qmatmul(x, codes, scale, threads, bias)


def tiled_gemm(x: Tensor, codes: Tensor, scale: Tensor, mins: Tensor | None, bits: int, outputs: int,
               threads: int, bias: Tensor | None = None) -> Tensor:
    """Many int8 rows x [M, K] float32 times a tiled weight (+ bias: float32 [N], added as each output is
    stored, the bits of adding it after) -> [M, N]: ``qmatmul``'s bits (activation_bits 8), on AMX's tile
    unit where the CPU has it and the rows are many (layers/qgemm_amx.cpp)."""
    return _ops().tiled_gemm(x, codes, scale, mins, bits, outputs, threads, bias)


def tiled_gated_gemm(x: Tensor, codes: Tensor, scale: Tensor, mins: Tensor | None, bits: int, outputs: int,
                     threads: int, activation: int) -> Tensor:
    """x [M, K] float32 times a tiled [gate | up] weight (``outputs`` = 2I) -> act(gate) * up [M, I] (activation 0:
    SiLU, 1: GELU tanh): ``gated(tiled_gemm(...))``'s bits, the product never written where its 4-bit rows run 16
    to a register (layers/qlanes_gated.cpp)."""
    return _ops().tiled_gated_gemm(x, codes, scale, mins, bits, outputs, threads, activation)


def set_amx(enabled: bool | None = None) -> bool:
    """Whether many-row int8 products use AMX (layers/amx.h; the same results, faster); ``enabled``
    switches it on (where the CPU and OS allow it, with AVX-512 on) or off first. False without the extension."""
    ops = _ops()
    return ops is not None and bool(ops.set_amx(-1 if enabled is None else int(enabled)))


def dequantize(codes: Tensor, scale: Tensor, mins: Tensor | None, bits: int, group: int, threads: int,
               outputs: int = -1) -> Tensor:
    """A quantized weight's codes -> float32 [N, K]."""
    return _ops().dequantize(codes, scale, mins, bits, group, threads, outputs)


def float_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, threads: int, in_place_rows: int,
                 aliased_in_place_rows: int) -> Tensor:
    """float32 x [M, K] @ weight [K, N] (+ bias) -> [M, N], each output summed in one fixed order; the in-place
    row limits (``KernelChoice.in_place_rows``, layers/float_rows_choice.py) choose the speed, not the bits."""
    return _ops().float_matmul(x, weight, bias, threads, in_place_rows, aliased_in_place_rows)


def set_avx512(enabled: bool | None = None) -> bool:
    """Whether the kernels use AVX-512 + VNNI (layers/isa.h; the same results as AVX2, faster); ``enabled``
    switches them on (where the CPU has them) or off first. False without the extension."""
    ops = _ops()
    return ops is not None and bool(ops.set_avx512(-1 if enabled is None else int(enabled)))


def onednn_available() -> bool:
    """Whether PyTorch ships oneDNN's float32 GEMM with fused activations (inductor's CPU linear)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None, attr: str, algorithm: str) -> Tensor:
    """oneDNN's float32 x @ weight^T + bias, with the post-op ``attr`` ("none", "relu", "gelu")."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, attr, [], algorithm)


# -- attention (attention.cpp, cross_attention.cpp) and beam search (beam_search.cpp) -----------
def paged_attention(q: Tensor, keys: Tensor, values: Tensor, k_new: Tensor | None, v_new: Tensor | None,
                    write_slots: Tensor | None, table: Tensor, key_start: Tensor, positions: Tensor, block: int,
                    window: int, scale: float, bias: Tensor | None) -> Tensor:
    """One query per row over its blocks of a pool: q [B, H, D] -> [B, H, D] (k_new, v_new written first)."""
    return _ops().paged_attention(q, keys, values, k_new, v_new, write_slots, table, key_start, positions, block,
                                  window, scale, bias)


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, threads: int) -> Tensor:
    """Attention on the kernel pool (layers/prompt_attention.cpp): q [B, H, T, D], k, v [B, Hkv, S, D],
    mask [B, 1 | H, T, S] or None -> [B, H, T, D]."""
    return _ops().prompt_attention(q, k, v, mask, scale, threads)


def cross_attention(q: Tensor, keys: Tensor, values: Tensor, lengths: Tensor, scale: float,
                    threads: int = 1) -> Tensor:
    """Queries [B, H, T, D] over each source's own keys (``lengths`` [B]) -> [B, H, T, D]."""
    return _ops().cross_attention(q, keys, values, lengths, scale, threads)


def paged_cross_attention(q: Tensor, keys: Tensor, values: Tensor, table: Tensor, lengths: Tensor, scale: float,
                          threads: int = 1) -> Tensor:
    """Queries [B, H, T, D] over each row's source in blocks (keys, values [blocks, H, block, D],
    table [B, n] block ids, ``lengths`` [B]) -> [B, H, T, D]."""
    return _ops().paged_cross_attention(q, keys, values, table, lengths, scale, threads)


def beam_candidates(logits: Tensor, running: Tensor, banned: Tensor, beams: int, keep: int,
                    threads: int = 1, row_banned: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A beam step's log-softmax, running scores and top ``keep`` candidates: logits [B*K, V] ->
    (scores, flat indices) [B, keep]; ``banned`` [E] ids score -inf in every row, ``row_banned`` [B*K, W]
    ids (V: none) in their own row."""
    return _ops().beam_candidates(logits, running, banned, beams, keep, threads, row_banned)


def beam_update(top_scores: Tensor, top_index: Tensor, eos: Tensor, vocab_size: int, step: int, max_new: int,
                offer_divisor: float, best_divisor: float, stop_when_done: bool, running: Tensor,
                running_tokens: Tensor, fin_tokens: Tensor, fin_length: Tensor, fin_scores: Tensor, fin_done: Tensor,
                improvable: Tensor) -> Tensor:
    """One sample's beam bookkeeping after its step's candidates (engine/beam_scores.py), the state updated in
    place -> int64 [2K + 1]: the beam each new beam continues [K], their last tokens [K], whether to go on."""
    return _ops().beam_update(top_scores, top_index, eos, vocab_size, step, max_new, offer_divisor, best_divisor,
                              stop_when_done, running, running_tokens, fin_tokens, fin_length, fin_scores, fin_done,
                              improvable)


def whisper_logits_rules(logits: Tensor, masked: Tensor, always: Tensor, at_begin: Tensor, rows: list[int],
                         ints: list[int]) -> None:
    """Whisper's logits rules (speech/rules.py's ``LogitsRules``) on logits [R, V] (whisper_rules.cpp), into ``masked``
    [R, V] (contiguous float32). ``always``, ``at_begin``: token ids suppressed at every step, at a row's first;
    ``rows``: per row its generated count, whether its last and second-to-last tokens are timestamps (the latter also
    with fewer than 2), its last timestamp or -1; ``ints``: timestamps, timestamp_begin, eot, the last first one."""
    _ops().whisper_logits_rules(logits, masked, always, at_begin, rows, ints)


# -- element-wise steps (elementwise.cpp) -------------------------------------------------------
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return _ops().rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, delta_weight: Tensor | None, weight: Tensor,
                 eps: float, threads: int = 1) -> tuple[Tensor, Tensor]:
    """(x + delta (* delta_weight's norm), its RMSNorm); threads > 1: rows split over them (the same bits)."""
    if threads > 1:
        return _ops().add_rms_norm__split(x, delta, delta_weight, weight, eps, threads)
    return _ops().add_rms_norm(x, delta, delta_weight, weight, eps)


def qkv_heads(qkv: Tensor, num_heads: int, num_kv_heads: int, norm_weight: Tensor | None, eps: float,
              cos: Tensor, sin: Tensor, threads: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    """[B, T, (H + 2 Hkv) D] -> q [B, H, T, D], k, v [B, Hkv, T, D], q/k normed and rotated; threads > 1:
    rows split over them (the same bits)."""
    if threads > 1:
        return _ops().qkv_heads__split(qkv, num_heads, num_kv_heads, norm_weight, eps, cos, sin, threads)
    return _ops().qkv_heads(qkv, num_heads, num_kv_heads, norm_weight, eps, cos, sin)


def gated(gate_up: Tensor, activation: int, threads: int = 1) -> Tensor:
    """[..., 2I] -> act(gate) * up [..., I] (activation 0: SiLU, 1: GELU tanh); threads > 1: rows split over
    them (the same bits)."""
    if threads > 1:
        return _ops().gated__split(gate_up, activation, threads)
    return _ops().gated(gate_up, activation)


# -- one decoder block (decode_block.cpp) ----------------------------------------------------------
class BlockProduct(NamedTuple):
    """One product's ints in ``decode_block``: bits (0: a float32 weight), group, activation bits,
    outputs, and the kernel threads it gets."""

    bits: int
    group: int
    activation_bits: int
    outputs: int
    threads: int


@dataclass(frozen=True, slots=True)
class DecodeBlockArgs:
    """``decode_block``'s scalars, by name; the op takes them packed (``ints``, ``floats``: built once
    here, as decode_block.cpp lays them out: 7 head ints, then 5 per product)."""

    num_heads: int
    num_kv_heads: int
    activation: int  # 0: SiLU, 1: GELU (tanh)
    block_size: int
    window: int  # 0: none
    threads: int  # the forward's thread budget
    attention_min_work: int  # multiply-adds from which the attention gets ``threads``
    products: tuple[BlockProduct, ...]  # qkv, o, gate_up, down (+ a second qkv product: decode_block.cpp)
    norm_eps: float
    scale: float  # attention scale
    ints: list[int] = field(init=False, repr=False, compare=False)
    floats: list[float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.products) not in (4, 5):
            raise ValueError(f"decode_block runs 4 products (qkv, o, gate_up, down) and maybe a second qkv one, "
                             f"not {len(self.products)}")
        ints = [self.num_heads, self.num_kv_heads, self.activation, self.block_size, self.window, self.threads,
                self.attention_min_work, *(int(i) for product in self.products for i in product)]
        object.__setattr__(self, "ints", ints)
        object.__setattr__(self, "floats", [float(self.norm_eps), float(self.scale)])


def decode_block(x: Tensor, h: Tensor, weights: list[Tensor | None], args: DecodeBlockArgs, cos: Tensor,
                 sin: Tensor, keys: Tensor, values: Tensor, slots: Tensor, table: Tensor, key_start: Tensor,
                 positions: Tensor) -> tuple[Tensor, Tensor]:
    """One Llama-family block for a pure decode step: (x, h) [1, N, C] -> the next block's (x, h).
    ``weights``: (codes, scale, mins, bias) or ([in, out] buffer, None, None, bias) per product, then the
    MLP norm and the next norm, then the second qkv product's 4 entries where ``args`` has one; keys, values [slots, Hkv, D] of the layer (written in place); slots [N];
    table [N, n]; key_start, positions [N]."""
    return _ops().decode_block(x, h, weights, args.ints, args.floats, cos, sin, keys, values, slots, table,
                               key_start, positions)


def decode_stack_holder(blocks: list[tuple[list[Tensor | None], int]]):
    """A ``DecodeStack`` (decode_stack.cpp) holding each block's ``decode_block`` weight list and kind
    (numbered in order of first use), in block order: made once per model."""
    stack = torch.classes.fastdecode_kernels.DecodeStack()
    for weights, kind in blocks:
        stack.add_block(weights, kind)
    return stack


def decode_stack(stack, x: Tensor, h: Tensor, ints: list[int], floats: list[float], cos: Tensor, sin: Tensor,
                 keys: list[Tensor], values: list[Tensor], slots: Tensor, table: Tensor, key_start: Tensor,
                 positions: Tensor) -> tuple[Tensor, Tensor]:
    """Every block of ``stack`` for a pure decode step of a model whose layers share one attention kind: (x, h)
    [1, N, C] -> after the last block. ``ints``: each kind's ``DecodeBlockArgs.ints`` in kind order; the rest:
    ``decode_block``'s (keys, values: every layer's pool). Through the C++ entry point (``_op``): the overload
    walks the arguments of an op taking a TorchBind object for tracing (~50 us a step), which never traces it."""
    return _ops().decode_stack._op(stack, x, h, ints, floats, cos, sin, keys, values, slots, table, key_start,
                                   positions)


def decode_stack_logits(stack, tokens: Tensor, end_ints: list[int], ints: list[int], floats: list[float], *step_tensors
                        ) -> Tensor:
    """The whole step over a stack whose ends are set (decode_stack.cpp): tokens [N] -> logits [1, N, V];
    ``step_tensors``: ``decode_stack``'s cos, sin, keys, values, slots, table, key_start, positions."""
    return _ops().decode_stack_logits._op(stack, tokens, end_ints, ints, floats, *step_tensors)


def argmax_rows(logits: Tensor) -> Tensor:
    """float32 logits [R, V] -> each row's argmax [R] (int64), the index ``torch.argmax(dim=-1)`` picks."""
    return _ops().argmax_rows(logits)


def cross_decode_block(x: Tensor, weights: list[Tensor | None], ints: list[int], floats: list[float], keys: Tensor,
                       values: Tensor, slots: Tensor, table: Tensor, key_start: Tensor, positions: Tensor,
                       source_keys: list[Tensor], source_values: list[Tensor], source_lengths: list[Tensor]) -> Tensor:
    """One pre-LayerNorm encoder-decoder decoder layer (Whisper's) for a pure decode step over encoded
    sources: x [1, N, C] -> the next layer's x. ``weights``, ``ints``, ``floats``: as decode_block.cpp's
    cross_decode_block lays them out (models/whisper_decode.py packs them); keys, values [slots, H, D] of the
    layer (written in place); slots [N]; table [N, n]; key_start, positions [N]; per source its cross K, V
    [1, H, S, D] and length [1]."""
    return _ops().cross_decode_block(x, weights, ints, floats, keys, values, slots, table, key_start, positions,
                                     source_keys, source_values, source_lengths)


def cross_decode_stack_holder(layers: list[list[Tensor | None]]):
    """A ``CrossDecodeStack`` (cross_decode_stack.cpp): each Whisper decoder layer's weights, once per model."""
    stack = torch.classes.fastdecode_kernels.CrossDecodeStack()
    for weights in layers:
        stack.add_layer(weights)
    return stack


def cross_decode_stack(stack, x: Tensor, ints: list[int], floats: list[float], keys: list[Tensor],
                       values: list[Tensor], slots: Tensor, table: Tensor, key_start: Tensor, positions: Tensor,
                       source_keys: list[Tensor], source_values: list[Tensor], source_lengths: list[Tensor]) -> Tensor:
    """Every layer of ``stack`` in order (``cross_decode_block`` each, the same bits) for a pure decode step
    whose layers share one attention kind: x [1, N, C] -> after the last layer. ``ints``: the 5 head ints,
    each layer's 30 product ints, each source's 3; keys, values: every layer's pool; source_keys,
    source_values: layer-major (each layer's sources in order); source_lengths: per source."""
    return _ops().cross_decode_stack(stack, x, ints, floats, keys, values, slots, table, key_start, positions,
                                     source_keys, source_values, source_lengths)


# -- loading --------------------------------------------------------------------------------------
class KernelOps:
    """The extension's ops by name, each its ``default`` overload: calling an OpOverload directly costs
    about 5.5 us against 9.4 us through the overload packet (``torch.ops.ns.op``), and a decode step
    calls about ten per layer. Resolved on first use, then a plain attribute. ``op__name``: the op's overload
    ``name`` (``gated__split``: ``gated.split``)."""

    def __init__(self, namespace) -> None:
        self._namespace = namespace

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        op, _, overload_name = name.partition("__")
        overload = getattr(getattr(self._namespace, op), overload_name or "default")
        setattr(self, name, overload)
        return overload


def _load_ops():
    if not cpu_has_avx2():
        log.info("fastdecode: CPU without AVX2/FMA/F16C; quantized matmuls use the PyTorch fallback")
        return None
    try:
        library = library_path()
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            log.warning("fastdecode: building the quantized kernels (once, about a minute)")
            # cpp_extension.load registers the ops itself; loading again is a no-op then, and needed when
            # another process finished the build while this one waited for the lock (build() returns early).
            torch.ops.load_library(str(build()))
        register_fake()
        return KernelOps(torch.ops.fastdecode_kernels)
    except Exception as exc:  # noqa: BLE001 - any build failure means: use the fallback
        log.warning("fastdecode: quantized kernels unavailable (%s); using the PyTorch fallback", exc)
        return None
