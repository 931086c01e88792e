"""Quantized weights: ``QuantizedWeight`` (codes in groups, with scales and optional mins) and its kernels.

One format serves every quantized type, so one kernel family serves them all:

    w[n, k] = scale[n, g] * code[n, k] + min[n, g]        g = k // group, min absent = 0

- ``bits=4``: codes are nibbles, 16 bytes per 32-group, byte j holding element j (low nibble) and
  element j + 16 (high nibble): GGUF's own Q4_0/Q4_1 byte order, so those blocks are copied as they are.
- ``bits=8``: codes are int8, one per weight.
- ``bits=6`` (Q6_K, rows layout, groups of 16): GGUF's packed ql/qh bytes, 192 per 256 inputs, which the
  kernels unpack in registers into the int8 codes a ``bits=8`` weight would hold (layers/six_bit.py): the
  same products, bit for bit, from 6 bits read per weight.
- scale/min are float16 where they are exact copies of GGUF's fp16 block scales (Q4_0, Q4_1, Q8_0), int8
  records of compact K-quant scales (Q4_K, Q5_K, Q6_K as GGUF stores them: per 256 inputs int8 sub-scale
  codes and a float16 super-scale, decoded in the kernels to the exact float32 products d * code:
  layers/kscales.py), else float32 (our own int8/int4 quantization).

Layouts of the stored codes/scale/mins:
- rows: codes [N, K*bits/8] as above, scale/mins [N, K/group];
- tiled (``tiled()``: every 4- and 8-bit format with groups of 32, made once at load): 8 outputs
  interleaved 4 code bytes at a time per block of 32 inputs, codes [ceil(N/8), K/32, 8*32*bits/8],
  scale/mins [ceil(N/8), K/32, 8] (compact: [ceil(N/8), K/256, 80]), the last tile padded with zero rows
  (layout: layers/qtiles.cpp).
  ``outputs`` holds N. It is a pure byte shuffle: ``dequantize`` (and embedding lookups) read it.

The matrix is stored [out, in] (rows are outputs) and ``transposed`` marks the canonical [in, out] view
that models hold and ``.t()`` (as for float buffers, so model code is the same for both).

Which arithmetic a row gets depends on its role, never on what else is in the step:

- generated rows (decode steps, beams: a token the model produced): on CPU the AVX2 extension
  (``ops.qmatmul``) quantizes each activation row to int8 per 32 inputs and multiplies it by the codes
  in integer arithmetic (llama.cpp's scheme; error bound in tests/unit/test_quantized.py);
- prompt rows (prompt chunks, encoder sources, scoring; the step plan's ``Products``, handed to every
  product, marks them: layers/products.py): multiplied by the weights' exact float32 values, exact up to summation
  order: on CPU the extension's exact kernel (layers/exact_matmul.cpp: 64 outputs decoded at a time into
  cache, one fixed summation order per row and output), elsewhere the decoded matrix and the float
  GEMM. Rounding prompt activations to int8 flips near ties that decide the answer (see ``for_logits``);
- the logits layer (``for_logits``): float32 activations in the kernel for every row, exact up to
  summation order;
- weights marked by ``int8_prompt_rows`` (encoder-decoder models quantized at load, as CTranslate2 runs
  them): every row the int8 kernel, whatever its role.

Prompt rows on int8 (the model's ``KernelChoice`` with ``prompt_rows="int8"``, or "int8-mlp" for the weights
marked ``in_mlp``, carried by ``Products``; or ``int8_prompt_rows``) take the decode kernel, except on
the rows layout's 8- or 6-bit codes in groups of 16 (Q6_K), whose prompt rows take the int8 prompt GEMM
(layers/qprompt.cpp: 16 outputs repacked per pass, VNNI or AVX2; ``has_prompt_kernel``). Int8 products of
several rows of a tiled weight (such prompt rows, batches, beams, verify steps) go through ``ops.tiled_gemm``:
the decode kernel's bits, on AMX's tile unit where the CPU has it (layers/qgemm_amx.cpp; likewise Q6_K's
prompt GEMM, layers/qprompt_amx.cpp).

Each kernel's row result is bitwise the same whatever else is in its product: a row's products never
depend on its batch or on how its prompt was chunked (attention over prompt chunks is SDPA, whose
sums may still differ in the last bit between chunkings). Without the extension (no AVX2, no compiler, CUDA),
or with the kernel choice's ``quantized_kernels`` off (tests that check a conversion at 1e-4), every
product takes the exact path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import kscales, ops, six_bit
from .gemm import gemm
from .products import ALL_PROMPT, Products
from .threads import kernel_threads

TILE = 8  # outputs per tile of the tiled layout
# Without the extension's exact kernel (another device, no compiler) prompt rows go through the float
# GEMM: oneDNN's gives a row the same bits whatever the row count from 4 rows on (tested), but 1 to 3
# rows may take another kernel (differences ~1e-5, which the int8 rounding of later generated rows can
# turn into different tokens): fewer prompt rows are padded to 4.
GEMM_MIN_ROWS = 4


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    kind: str  # what it came from: "Q4_1", "Q8_0", "Q6_K", "int8", "int4"...
    bits: int  # 4, 6 (packed Q6_K: six_bit.py) or 8
    group: int  # inputs per scale: 32 (16 for Q6_K)
    codes: torch.Tensor  # int8 [N, K], uint8 [N, K/2] (4 bits) or [N, 3K/4] (6 bits)
    scale: torch.Tensor  # [N, K/group] float16 or float32, or compact records int8 [N, K/256, bytes] (kscales.py)
    mins: torch.Tensor | None  # like scale, or None (symmetric codes)
    transposed: bool = False  # True: seen as [K, N] (the canonical [in, out] view)
    dtype: torch.dtype = torch.float32  # the model's activations: embedding rows come out in it
    activation_bits: int = 8  # the decode kernel's activations: 8 (int8 per 32 inputs) or 32 (exact; for_logits)
    outputs: int = -1  # N of the stored [out, in] matrix (given for the tiled layout; rows: from scale)
    exact_prompt_rows: bool = True  # False: prompt rows take the int8 kernel too (``int8_prompt_rows``)
    in_mlp: bool = False  # one of a block's MLP products (gate, up, down: ``in_mlp``), for prompt_rows="int8-mlp"

    def __post_init__(self) -> None:  # read by every product: computed once
        if not self.is_tiled:
            object.__setattr__(self, "outputs", self.scale.shape[0])
        per_scale = kscales.SUPER if kscales.is_compact(self.scale) else self.group  # inputs per scale (record)
        object.__setattr__(self, "inputs", self.scale.shape[1] * per_scale)  # K

    @property
    def is_tiled(self) -> bool:
        return self.codes.dim() == 3

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.inputs, self.outputs) if self.transposed else (self.outputs, self.inputs))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.mins) if t is not None)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def t(self) -> QuantizedWeight:
        return dataclasses.replace(self, transposed=not self.transposed)

    @property
    def T(self) -> QuantizedWeight:  # noqa: N802 - numpy's name, used by layout functions
        return self.t()

    def take_rows(self, rows: torch.Tensor) -> QuantizedWeight:
        """The same weight with its output rows reordered (e.g. undoing a Q/K row permutation)."""
        assert not self.transposed
        codes, scale, mins = rows_layout(self, rows)
        taken = dataclasses.replace(self, codes=codes.contiguous(), scale=scale.contiguous(),
                                    mins=None if mins is None else mins.contiguous(), outputs=-1)
        return tiled(taken) if self.is_tiled else taken

    def row_range(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows [start, stop) as views (tiled: whole tiles, start and stop multiples of TILE or stop = N)."""
        if not self.is_tiled:
            return dataclasses.replace(self, codes=self.codes[start:stop], scale=self.scale[start:stop],
                                       mins=None if self.mins is None else self.mins[start:stop])
        assert start % TILE == 0 and (stop % TILE == 0 or stop == self.outputs), (start, stop)
        tiles = slice(start // TILE, -(-stop // TILE))
        return dataclasses.replace(self, codes=self.codes[tiles], scale=self.scale[tiles],
                                   mins=None if self.mins is None else self.mins[tiles], outputs=stop - start)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> QuantizedWeight:
        """Moved to ``device``; ``dtype`` sets the activations' dtype (products are float32, cast to it)."""
        return dataclasses.replace(self, codes=self.codes.to(device), scale=self.scale.to(device),
                                   mins=None if self.mins is None else self.mins.to(device), dtype=dtype or self.dtype)


def tiled(weight: QuantizedWeight) -> QuantizedWeight:
    """The weight in the tiled layout where its format has tiled kernels (4- or 8-bit codes, groups of
    32), else as it is. One copy of the codes, scales and mins (a byte shuffle; N padded to tiles)."""
    if weight.is_tiled or weight.group != 32 or weight.bits not in (4, 8):
        return weight
    N, groups = weight.outputs, weight.inputs // 32
    tiles = -(-N // TILE)

    def tile(t: torch.Tensor) -> torch.Tensor:  # [N, groups * width] -> [tiles, groups, TILE * width]
        t = t.contiguous()
        if tiles * TILE != N:
            t = torch.cat([t, t.new_zeros(tiles * TILE - N, t.shape[1])])  # [tiles * TILE, ...]
        width = t.shape[1] // groups
        t = t.view(tiles, TILE, groups, width)  # [tiles, TILE, groups, width]
        return t.permute(0, 2, 3, 1).contiguous().view(tiles, groups, TILE * width)  # [tiles, groups, width, TILE]

    # codes move 4 bytes at a time (one int32 element: a 5x faster copy than byte by byte)
    codes = tile(weight.codes.contiguous().view(torch.int32)).view(weight.codes.dtype)
    tile_scales = (lambda t: kscales.tile_records(t, tiles)) if kscales.is_compact(weight.scale) else tile
    return dataclasses.replace(weight, codes=codes, scale=tile_scales(weight.scale),
                               mins=None if weight.mins is None else tile_scales(weight.mins), outputs=N)


def keeps_rows_layout(name: str) -> bool:
    """Canonical weights kept in the rows layout at load: embedding tables (row lookups) and the LM head
    (a tied one is the embedding table; its float32-activation kernel, for_logits, measured 0.85-0.9x as
    fast on the tiled layout at M = 1 and 8: benchmarks/qmatmul_kernels.py --jobs layouts)."""
    return name.endswith("embed.weight") or name == "lm_head.weight"


def rows_layout(weight: QuantizedWeight, rows: torch.Tensor | None = None):
    """(codes [R, K*bits/8], scale [R, K/group] (compact: records [R, K/256, bytes]), mins or None) of the
    given output rows (all when None) in the rows layout: views or gathers, whichever layout the weight has."""
    codes, scale, mins = weight.codes, weight.scale, weight.mins
    if not weight.is_tiled:
        if rows is None:
            return codes, scale, mins
        return codes[rows], scale[rows], None if mins is None else mins[rows]
    tiles, groups, _ = codes.shape
    if rows is None:
        rows = torch.arange(weight.outputs, device=codes.device)
    tile, lane = rows // TILE, rows % TILE
    by_lane = codes.view(tiles, groups, -1, TILE, 4)  # [tiles, groups, width, TILE, 4 bytes]
    picked = by_lane[tile, :, :, lane, :].reshape(len(rows), -1)  # [R, groups, width, 4] -> [R, K*bits/8]
    if kscales.is_compact(scale):
        return (picked, kscales.untile_records(scale, tile, lane),
                None if mins is None else kscales.untile_records(mins, tile, lane))
    return picked, scale[tile, :, lane], None if mins is None else mins[tile, :, lane]  # [R, groups] each


def dequantize(weight: QuantizedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [R, K] of the given output rows (all rows when None), in the stored [out, in] orientation."""
    codes, scale, mins = rows_layout(weight, rows)
    if kscales.is_compact(scale):  # the float32 values d * code (exact)
        scale, mins = kscales.expand(scale, weight.group), None if mins is None else kscales.expand(mins, weight.group)
    R, groups = scale.shape
    if weight.bits == 4:
        nibbles = codes.view(R, groups, 16)  # [R, K/32, 16] bytes
        values = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # [R, K/32, 32]: low then high
    elif weight.bits == 6:
        values = six_bit.unpack(codes).view(R, groups, weight.group).float()  # [R, K/G, G]
    else:
        values = codes.view(R, groups, weight.group).float()  # [R, K/G, G]
    values = values * scale.float()[..., None]
    if mins is not None:
        values = values + mins.float()[..., None]
    return values.view(R, groups * weight.group)  # [R, K]


def dense_weight(weight: QuantizedWeight, work: int, threads: int) -> torch.Tensor:
    """The whole matrix as float32 [N, K] for a GEMM with ``work`` multiply-adds: the AVX2 decoder on
    CPU (bit-identical to ``dequantize``, one pass, split over up to ``threads`` like the product), else
    ``dequantize``."""
    if weight.device.type != "cpu" or not ops.available():
        return dequantize(weight)
    threads = kernel_threads(min(work, weight.outputs * weight.inputs), threads)  # the decoder's own size caps it
    return ops.dequantize(weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads, weight.outputs)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None,
                     products: Products) -> torch.Tensor:
    """x [..., K] @ weight[N, K]^T + bias -> [..., N] in x's dtype; ``products``: the forward's row
    roles and kernel choice (which arithmetic each row gets) and thread budget.

    Called for every product of a decode step: casts, copies and reshapes happen only where needed."""
    if weight.transposed:
        raise ValueError("linear() takes the [out, in] view of a quantized weight: call .t() on the canonical one")
    N, K = weight.outputs, weight.inputs
    rows = x if x.dim() == 2 else x.reshape(-1, K)  # [M, K]
    if rows.dtype != torch.float32:
        rows = rows.float()
    choice = products.kernels  # the model's, chosen at load
    kernel = choice.quantized_kernels and rows.is_cpu and ops.available()
    threads = products.threads
    exact_prompts = weight.exact_prompt_rows and choice.exact_prompts(weight.in_mlp)
    roles = products.roles if weight.activation_bits == 8 and (exact_prompts or has_prompt_kernel(weight)) else None
    # a float32 [N] bias is added inside the int8 kernels, as each output is stored (the same float addition)
    fused = bias if bias is not None and bias.dtype == torch.float32 and bias.dim() == 1 and bias.is_contiguous() else None
    if not kernel or (roles is ALL_PROMPT and exact_prompts):
        out = _exact_product(rows, weight, threads, choice.float_gemm)
    elif roles is ALL_PROMPT or roles is None:
        product = _int8_prompt_product if roles is ALL_PROMPT else _kernel_product
        out = product(rows, weight, threads, fused)
        bias = None if fused is not None else bias
    else:  # a step mixing prompt and generated rows: each part its own way
        if rows.shape[0] != roles.rows:
            raise RuntimeError(f"row roles were given for {roles.rows} rows, the product has {rows.shape[0]}")
        out = rows.new_empty(rows.shape[0], N)
        out[roles.generated] = _kernel_product(rows[roles.generated], weight, threads)
        prompt = rows[roles.prompt]
        out[roles.prompt] = (_exact_product(prompt, weight, threads, choice.float_gemm) if exact_prompts
                             else _int8_prompt_product(prompt, weight, threads))
    if bias is not None:
        out += bias  # (a fresh tensor: in place saves a pass over it; the same float addition as the kernel's)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], N)  # [..., N]
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _kernel_product(rows: torch.Tensor, weight: QuantizedWeight, budget: int,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [M, K] float32 -> [M, N] (+ bias: float32 [N]) through the AVX2 / AVX-512 kernel; many int8 rows
    of a tiled weight through ``ops.tiled_gemm`` (the same bits; AMX's tile unit where the CPU has it)."""
    M, K, N = rows.shape[0], weight.inputs, weight.outputs
    if tiled_rows(M, weight):
        return ops.tiled_gemm(rows if rows.is_contiguous() else rows.contiguous(), weight.codes, weight.scale,
                              weight.mins, weight.bits, weight.outputs, kernel_threads(M * K * N, budget), bias)
    return ops.qmatmul(rows if rows.is_contiguous() else rows.contiguous(), weight.codes, weight.scale, weight.mins,
                       weight.bits, weight.group, kernel_threads(M * K * N, budget), weight.activation_bits,
                       weight.outputs, bias)


def tiled_rows(M: int, weight: QuantizedWeight) -> bool:
    """Whether the kernel product of M rows runs on ``ops.tiled_gemm``: many int8 rows of a tiled weight."""
    return M > 1 and weight.is_tiled and weight.activation_bits == 8


def has_prompt_kernel(weight: QuantizedWeight) -> bool:
    """Whether int8 prompt rows of ``weight`` take a kernel of their own (layers/qprompt.cpp: the rows
    layout's 8- or 6-bit codes in groups of 16, Q6_K, whose decode kernel is slow at many rows); every other
    format's int8 prompt rows take the decode kernel (the tiled one: VNNI, 8 rows at a time)."""
    return weight.bits in (6, 8) and weight.group == 16 and weight.mins is None and not weight.is_tiled


def _int8_prompt_product(rows: torch.Tensor, weight: QuantizedWeight, budget: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """Prompt rows [M, K] float32 -> [M, N] (+ bias: float32 [N]) on int8-rounded activations (``prompt_rows="int8"``
    or ``int8_prompt_rows``): each row the same bits at any row count (tests/unit/test_prompt_gemm.py)."""
    rows = rows if rows.is_contiguous() else rows.contiguous()
    if not (has_prompt_kernel(weight) and rows.is_cpu):
        return _kernel_product(rows, weight, budget, bias)
    return ops.prompt_qmatmul(rows, weight.codes, weight.scale,
                              kernel_threads(rows.shape[0] * weight.inputs * weight.outputs, budget), bias)


def _exact_product(rows: torch.Tensor, weight: QuantizedWeight, budget: int, float_gemm: str) -> torch.Tensor:
    """rows [M, K] float32 -> [M, N]: the product with the weight's exact float32 values.

    On the CPU, the extension's ``exact_qmatmul`` (layers/exact_matmul.cpp) decodes 64 outputs at a time
    into L2 and multiplies them there: each (row, output) summed in the same order whatever the row
    count (no dense copy of the matrix, no padding). Elsewhere the decoded matrix goes through the
    float GEMM (``float_gemm``: the model's choice of it)."""
    M = rows.shape[0]
    if rows.is_cpu and weight.device.type == "cpu" and ops.available():
        return ops.exact_qmatmul(rows if rows.is_contiguous() else rows.contiguous(), weight.codes, weight.scale,
                                 weight.mins, weight.bits, weight.group,
                                 kernel_threads(M * weight.inputs * weight.outputs, budget), weight.outputs)
    dense = dense_weight(weight, max(M, GEMM_MIN_ROWS) * weight.inputs * weight.outputs, budget)
    if M >= GEMM_MIN_ROWS or not rows.is_cpu:
        return gemm(rows, dense, None, None, budget, float_gemm)
    padded = torch.cat([rows, rows.new_zeros(GEMM_MIN_ROWS - M, rows.shape[1])])  # [GEMM_MIN_ROWS, K]
    return gemm(padded, dense, None, None, budget, float_gemm)[:M]


def for_logits(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight, its products with float32 activations (exact up to summation order).

    For the output (logits) layer: its products decide the tokens directly, and rounding its input
    to int8 moves logits by ~0.5% of their RMS, enough to flip near ties (the embedded model's first
    answer token to "What is the capital of France?" is a 0.09-logit tie, "The" 25.33 vs "L" 25.24;
    int8 activations answer "L'Étoile...", as llama.cpp does on the same file). That matrix is
    memory-bound at M = 1 and its float kernel (weights decoded once for 8 rows) is as fast as the
    integer one at M = 8 (measured: benchmarks/qmatmul_kernels.py), so exactness costs nothing there."""
    return dataclasses.replace(weight, activation_bits=32)


def int8_prompt_rows(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight, its prompt rows too on the int8 kernel: every row of every product the same
    arithmetic whatever its role (so batched == alone holds as for generated rows). For encoder-decoder
    models quantized at load, as CTranslate2 runs them: their prompt rows are encoder sources, whose
    products the int8 kernel runs with its own threads (parallel.h) where the float GEMM waits at
    OpenMP barriers on a busy machine. Effect measured in tests/unit/test_quantize_at_load.py."""
    return dataclasses.replace(weight, exact_prompt_rows=False)


def in_mlp(weight: QuantizedWeight) -> QuantizedWeight:
    """The same weight marked as one of a block's MLP products, whose prompt rows the default kernel
    choice (``prompt_rows="int8-mlp"``: layers/products.py) runs on int8 (loading/quantize.py marks them
    by their canonical names)."""
    return dataclasses.replace(weight, in_mlp=True)


# (bits, group) of the rows layout that ops.dequantize decodes (qrows.h FD_FOR_EACH_ROWS_FORMAT)
DECODED_ROWS = ((8, 32), (8, 16), (6, 16), (4, 32))


def embed(tokens: torch.Tensor, table: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """Embedding rows [..., C] of ``table`` [V, C]; a quantized table decodes only the rows looked up.

    A tied table is the [V, C] view of the logits layer's [C, V] buffer (loading/checkpoint.py): a row
    looked up there is C values a whole buffer row apart, so it is gathered along the buffer's rows
    instead (the same values: C runs over the buffer's rows, each read in ascending order). An 8 x 256
    source of bart-base on one core: 8 ms against F.embedding's 35 ms on the strided view."""
    if isinstance(table, torch.Tensor):
        if table.dim() == 2 and table.stride(0) == 1 and table.stride(1) != 1 and tokens.numel() > 1:
            rows = table.t().index_select(1, tokens.reshape(-1)).t()  # [C, T] -> [T, C]
            return rows.contiguous().view(*tokens.shape, table.shape[1])  # [..., C]
        return torch.nn.functional.embedding(tokens, table)
    ids = tokens.reshape(-1)  # [tokens]
    if (table.bits, table.group) in DECODED_ROWS and not table.is_tiled and ids.is_cpu and ops.available():
        # the extension's decoder on the rows looked up: dequantize's bits in one op instead of six
        rows = ops.dequantize(table.codes[ids], table.scale[ids], None if table.mins is None else table.mins[ids],
                              table.bits, table.group, 1, ids.shape[0])  # [tokens, C]
    else:
        rows = dequantize(table, ids)  # [tokens, C]
    rows = rows.to(table.dtype)
    return rows.view(*tokens.shape, rows.shape[-1])  # [..., C]


def quantize_matrix(weight: torch.Tensor, kind: str, tile: bool = True) -> QuantizedWeight:
    """float [N, K] -> QuantizedWeight (tiled layout unless ``tile`` is False: see ``keeps_rows_layout``). "int8": symmetric, absmax / 127 per 32 inputs (as Q8_0, scales float32);
    "int4": asymmetric, (max - min) / 15 per 32 inputs with the minimum as offset (as Q4_1).

    Error model: each weight moves by at most half a step of its group: |w - w_q| <= scale / 2."""
    N, K = weight.shape
    if K % 32:
        raise ValueError(f"cannot quantize a matrix with {K} inputs: not a multiple of 32")
    groups = weight.detach().float().contiguous().view(N, K // 32, 32)  # [N, K/32, 32]
    if kind == "int8":
        scale = groups.abs().amax(-1) / 127  # [N, K/32]
        codes = torch.round(groups / scale.clamp_min(1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
        weight = QuantizedWeight("int8", 8, 32, codes.reshape(N, K), scale.contiguous(), None)
        return tiled(weight) if tile else weight
    if kind == "int4":
        low, high = groups.amin(-1), groups.amax(-1)  # [N, K/32]
        scale = (high - low) / 15
        q = torch.round((groups - low[..., None]) / scale.clamp_min(1e-30)[..., None]).clamp(0, 15).to(torch.uint8)
        packed = q[..., :16] | (q[..., 16:] << 4)  # [N, K/32, 16]: element j low, j + 16 high
        weight = QuantizedWeight("int4", 4, 32, packed.reshape(N, K // 2), scale.contiguous(), low.contiguous())
        return tiled(weight) if tile else weight
    raise ValueError(f"unknown quantization {kind!r}")
