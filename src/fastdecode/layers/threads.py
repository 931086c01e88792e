"""How many threads one op gets: a forward runs on one thread; the quantized kernels and big products get more.

On a shared 2-core machine a second thread is often busy elsewhere, and every OpenMP-parallel op then
waits for it at a barrier: measured, a 1 x 576 x 1536 float32 matvec takes 0.16 ms on one thread and
30-40 ms on two; a decode step's attention (9 heads x 100 keys) 45 ms on two threads. It is not only
the products: PyTorch splits any element-wise op, copy or gather of more than 32K elements over its
threads, and in a batch-8 decode step of SmolLM2 on two threads (machine load ~10) the K/V block
gathers alone took 18 ms per call (a few microseconds of work), the whole step 1.9 s against 0.28 s
on one thread. So ``on_one_thread`` runs a model's forward on one thread, and inside it, out of the
thread budget the forward is handed explicitly (``Products.threads``, layers/products.py; the engine
sets it to its caller's thread count):

- the quantized kernels (``kernel_threads``) get the budget for every product of at least
  ``KERNEL_PARALLEL_MIN_WORK`` multiply-adds (every product of a decode step, the logits layer
  included): they split their outputs in pieces that the threads claim as they come (``parallel.h``),
  and helper threads take part only while they have a core of their own, so a second thread that is
  late or busy never makes the step wait;
- the decode attention op (``pool_threads_for``) splits its (row, KV head) items over the same pool,
  from the same size; a prompt's attention from 2 threads its (query chunk, row, head) SDPA calls
  (layers/attention.py, ``PARALLEL_MIN_WORK`` up: no OpenMP team beside the pool's helpers);
- OpenMP ops (``threads_for``: the float GEMM) get them only from ``PARALLEL_MIN_WORK``
  multiply-adds (an LM head over several rows, prompt chunks), where the split pays for the wait.

Outside a forward, ops below those sizes run on one thread (as before). These run once per product
in a decode step, so they are kept to a few attribute reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import TypeVar

import torch

PARALLEL_MIN_WORK = 1 << 24  # multiply-adds: ~0.5-1 ms on one AVX2 core
# The chunk-claiming kernels get the caller's threads from this size (benchmarks/kernel_threads.py).
# Below: a few microseconds of work, where handing out pieces costs as much as it saves. There is no upper
# bound: helpers that lose their core to another process stop taking pieces (parallel.h), and a piece is
# small (<= 16 chunks), so a long product (the logits layer: 28M at batch 1, 1.6 ms on one thread; a
# prompt) gains as much as the others.
KERNEL_PARALLEL_MIN_WORK = 1 << 16

_UNCHANGED = nullcontext()  # reusable: entering it does nothing
F = TypeVar("F", bound=Callable)


class _Threads:
    """Sets torch's thread count for a block and restores it after."""

    __slots__ = ("count", "previous")

    def __init__(self, count: int) -> None:
        self.count = count

    def __enter__(self) -> None:
        self.previous = torch.get_num_threads()
        torch.set_num_threads(self.count)

    def __exit__(self, *exc) -> None:
        torch.set_num_threads(self.previous)


def kernel_threads(work: int, budget: int) -> int:
    """Threads for a chunk-claiming quantized kernel of ``work`` multiply-adds, out of the forward's
    ``budget`` (``Products.threads``; an argument of the op: torch's own thread count stays as it is).
    Inside torch.compile (which cannot trace thread counts): 0, which the op reads as torch's thread
    count when it runs."""
    if work < KERNEL_PARALLEL_MIN_WORK:
        return 1
    if torch.compiler.is_compiling():
        return 0
    return budget


def threads_for(work: int, budget: int):
    """Context manager: torch's threads for an OpenMP op of ``work`` multiply-adds: the forward's
    ``budget`` when the op is big, else one. Inside torch.compile the thread count cannot be traced:
    the compiled graph keeps the caller's."""
    return _budget_from(PARALLEL_MIN_WORK, work, budget)


def pool_threads_for(work: int, budget: int):
    """Context manager: torch's threads for an op that splits its work over the kernel thread pool
    (parallel.h) and reads its thread count from torch (the decode attention op): the ``budget`` from
    ``KERNEL_PARALLEL_MIN_WORK`` multiply-adds, else one."""
    return _budget_from(KERNEL_PARALLEL_MIN_WORK, work, budget)


def one_thread():
    """Context manager: torch on one thread for a block of small ops (a beam step's bookkeeping)."""
    return _budget_from(PARALLEL_MIN_WORK, 0, 1)


def _budget_from(minimum: int, work: int, budget: int):
    """torch's thread count for one op: ``budget`` from ``minimum`` multiply-adds of ``work``, else one
    (unchanged inside torch.compile)."""
    if torch.compiler.is_compiling():
        return _UNCHANGED
    count = budget if work >= minimum else 1
    return _UNCHANGED if count == torch.get_num_threads() else _Threads(count)


def on_one_thread(forward: F) -> F:
    """Decorates a model's forward (encode, decode): its body runs on one torch thread; products and
    attention get the thread budget the forward is handed (``Products.threads``) back explicitly."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if torch.compiler.is_compiling() or torch.get_num_threads() == 1:
            return forward(*args, **kwargs)
        with _Threads(1):
            return forward(*args, **kwargs)

    return wrapped  # type: ignore[return-value]
