"""How many threads one op gets: small ops run on one thread.

On a shared 2-core machine a second thread is often busy elsewhere, and every parallel op then
waits for it at a barrier: measured, a 1 x 576 x 1536 float32 matvec takes 0.16 ms on one thread and
30-40 ms on two; a decode step's attention (9 heads x 100 keys) 45 ms on two threads. Splitting
pays only for ops of millions of multiply-adds, so below ``PARALLEL_MIN_WORK`` an op runs with one
thread and the caller's thread count is restored afterwards.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Iterator

import torch

PARALLEL_MIN_WORK = 1 << 22  # multiply-adds


@contextmanager
def threads_for(work: int) -> Iterator[None]:
    """Run the body on one thread when ``work`` (multiply-adds) is below PARALLEL_MIN_WORK.
    Inside torch.compile the thread count cannot be traced: the compiled graph keeps the caller's."""
    if torch.compiler.is_compiling():
        yield
        return
    threads = torch.get_num_threads()
    if threads == 1 or work >= PARALLEL_MIN_WORK:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
