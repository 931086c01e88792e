"""How many threads one op gets: a forward runs on one thread, and only big products get more.

On a shared 2-core machine a second thread is often busy elsewhere, and every parallel op then
waits for it at a barrier: measured, a 1 x 576 x 1536 float32 matvec takes 0.16 ms on one thread and
30-40 ms on two; a decode step's attention (9 heads x 100 keys) 45 ms on two threads. It is not only
the products: PyTorch splits any element-wise op, copy or gather of more than 32K elements over its
threads, and in a batch-8 decode step of SmolLM2 on two threads (machine load ~10) the K/V block
gathers alone took 18 ms per call (a few microseconds of work), the whole step 1.9 s against 0.28 s
on one thread. So ``one_thread_except_big_ops`` runs a model's forward on one thread, and inside it
``threads_for`` hands the caller's threads back to products of at least ``PARALLEL_MIN_WORK``
multiply-adds (an LM head over several rows, prompt chunks), where the split pays for the wait.
Outside a forward, ``threads_for`` runs ops below that size on one thread (as before).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

import torch

PARALLEL_MIN_WORK = 1 << 24  # multiply-adds: ~0.5-1 ms on one AVX2 core

# The thread count of the caller of the forward we are in (None: not inside one). A context
# variable, so threads (an engine's, a server's) never see each other's value.
_CALLER_THREADS: ContextVar[int | None] = ContextVar("fastdecode_caller_threads", default=None)
F = TypeVar("F", bound=Callable)


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    if previous == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def threads_for(work: int) -> Iterator[None]:
    """Threads for an op of ``work`` multiply-adds: the caller's when the op is big, else one.
    Inside torch.compile the thread count cannot be traced: the compiled graph keeps the caller's."""
    if torch.compiler.is_compiling():
        yield
        return
    caller = _CALLER_THREADS.get()
    big = work >= PARALLEL_MIN_WORK
    with _threads((caller or torch.get_num_threads()) if big else 1):
        yield


def one_thread_except_big_ops(forward: F) -> F:
    """Decorates a model's forward (encode, decode): its body runs on one thread, and ``threads_for``
    gives big products the caller's thread count back."""

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        if torch.compiler.is_compiling() or _CALLER_THREADS.get() is not None:
            return forward(*args, **kwargs)
        token = _CALLER_THREADS.set(torch.get_num_threads())
        try:
            with _threads(1):
                return forward(*args, **kwargs)
        finally:
            _CALLER_THREADS.reset(token)

    return wrapped  # type: ignore[return-value]
