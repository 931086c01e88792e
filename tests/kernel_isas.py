"""Kernel tests on each instruction set: the AVX-512 kernels (layers/isa.h, where the CPU has them) and the
AVX2 ones, which must give the same bits. Every helper switches the AVX-512 kernels back on after."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch

from fastdecode.layers import ops
from fastdecode.layers.quantized import QuantizedWeight

HAS_AVX512 = ops.set_avx512()
needs_avx512 = pytest.mark.skipif(not HAS_AVX512, reason="this CPU has no AVX-512 VNNI (the AVX2 kernels serve it)")


def on_both_isas(product: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """product() on the AVX-512 kernels (where the CPU has them) and on the AVX2 ones."""
    results = []
    try:
        for wide in (True, False):
            ops.set_avx512(wide)
            results.append(product())
    finally:
        ops.set_avx512(True)
    return results


def avx512_gives_the_avx2_bits(product: Callable[..., torch.Tensor], cases: Iterable[tuple]) -> None:
    """For each case (a tuple of arguments), product(*case) on the AVX-512 kernels and on the AVX2 ones:
    bitwise equal. Needs AVX-512 (``needs_avx512``): without it both runs would take the AVX2 kernels."""
    try:
        for case in cases:
            assert ops.set_avx512(True), "mark the test needs_avx512"
            fast = product(*case)
            assert not ops.set_avx512(False)
            assert torch.equal(fast, product(*case)), case
    finally:
        ops.set_avx512(True)


def rows_and_threads(rows: Iterable[int]) -> list[tuple[int, int]]:
    """(M, threads) for every row count in ``rows`` on 1 and 2 threads: the usual cases of a kernel test."""
    return [(M, threads) for M in rows for threads in (1, 2)]


def products_of_both(a: QuantizedWeight, b: QuantizedWeight, K: int, rows, activation_bits: int):
    """For each row count in ``rows``, 1 and 2 threads, without and with a bias: ((rows, threads, with bias),
    a's ``qmatmul`` of the same x on both ISAs, b's), to compare two layouts of the same weights."""
    x = torch.randn(max(rows), K, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(a.outputs, generator=torch.Generator().manual_seed(4))
    for M, threads in rows_and_threads(rows):
        def product(w, with_bias, M=M, threads=threads):
            return lambda: ops.qmatmul(x[:M], w.codes, w.scale, w.mins, w.bits, w.group, threads, activation_bits,
                                       w.outputs, bias if with_bias else None)
        for with_bias in (False, True):
            yield (M, threads, with_bias), on_both_isas(product(a, with_bias)), on_both_isas(product(b, with_bias))
