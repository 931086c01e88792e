"""The quantized kernels on several threads (layers/parallel.h) and the thread policy (layers/threads.py).

Outputs are split in fixed chunks that whichever thread is free claims, so every result must be bitwise
the same for any thread count, any interleaving and any caller thread. Speed is never asserted here
(benchmarks/kernel_threads.py measures it)."""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fastdecode.layers import ops
from fastdecode.layers import threads as thread_policy
from fastdecode.layers.linear import linear
from fastdecode.layers.products import KernelChoice, Products
from fastdecode.layers.quantized import for_logits, quantize_matrix

pytestmark = pytest.mark.skipif("not ops.available()", reason="no AVX2 kernel on this machine")


def product(weight, x, threads):
    return ops.qmatmul(x, weight.codes, weight.scale, weight.mins, weight.bits, weight.group, threads,
                       weight.activation_bits)


@pytest.mark.parametrize("kind", ["int4", "int8"])
@pytest.mark.parametrize("logits_layer", [False, True])
def test_products_are_bitwise_the_same_on_any_number_of_threads(kind, logits_layer):
    torch.manual_seed(0)
    for outputs, inputs, rows in [(1000, 128, 1), (333, 64, 5), (40, 96, 2)]:  # chunks of unequal sizes
        weight = quantize_matrix(torch.randn(outputs, inputs), kind)
        weight = for_logits(weight) if logits_layer else weight
        x = torch.randn(rows, inputs)
        alone = product(weight, x, 1)
        for threads in (2, 3, 2, 8):
            assert torch.equal(product(weight, x, threads), alone), (outputs, inputs, rows, threads)
        assert torch.equal(ops.dequantize(weight.codes, weight.scale, weight.mins, weight.bits, weight.group, 2),
                           ops.dequantize(weight.codes, weight.scale, weight.mins, weight.bits, weight.group, 1))


def test_two_caller_threads_at_once_get_the_same_results():
    """One caller owns the helper threads at a time; the other runs its product alone, not waiting."""
    torch.manual_seed(1)
    weight = quantize_matrix(torch.randn(2048, 256), "int4")
    x = torch.randn(3, 256)
    expected = product(weight, x, 1)
    mismatches = []

    def call_many():
        for _ in range(200):
            if not torch.equal(product(weight, x, 2), expected):
                mismatches.append(1)

    callers = [threading.Thread(target=call_many) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert not mismatches


def in_forked_child(target, timeout=120):
    """What target(queue) put in its queue, run in a forked child (which must exit within timeout: no
    hang) of a fresh interpreter whose kernel pool has made its helper threads. The parent is fresh
    because what the rest of a test session leaves in this process (other libraries' thread pools and
    fork handlers: Ray, gRPC, CTranslate2, uvicorn) is not what these tests are about."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_kernel_threads as t; "
            f"print(repr(t.fork_and_run(t.{target.__name__}, {timeout})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout + 120)
    assert result.returncode == 0, result.stderr[-3000:]
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


def fork_and_run(target, timeout: int):
    """(In the fresh parent) make the kernel pool's helpers, then run target(queue) in a forked child.
    torch's own ops on one thread, as in the test session (conftest.py): GNU OpenMP is not fork-safe, and a
    child forked after a parallel region of several OpenMP threads hangs in its next one."""
    torch.set_num_threads(1)
    torch.manual_seed(2)
    product(quantize_matrix(torch.randn(1024, 128), "int8"), torch.randn(1, 128), 2)  # helpers, not in the child
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue,))
    child.start()
    child.join(timeout=timeout)
    if child.is_alive():  # hung
        child.kill()
    assert child.exitcode == 0, f"the forked child exited with {child.exitcode} (None: hung for {timeout} s)"
    return queue.get(timeout=1)


def _child_product(queue):
    torch.manual_seed(2)
    weight = quantize_matrix(torch.randn(1024, 128), "int8")
    x = torch.randn(1, 128)
    queue.put(torch.equal(product(weight, x, 2), product(weight, x, 1)))


def test_a_forked_child_makes_its_own_helper_threads():
    assert in_forked_child(_child_product) is True  # the parent's helpers exist (they are not in the child)


def test_products_are_the_same_after_the_helpers_went_to_sleep():
    """Helpers spin a few ms after a job, then sleep until a caller wakes them: calls spaced wider than
    that (the helper asleep, waking up, or joining half-way) give the same results."""
    torch.manual_seed(4)
    weight = quantize_matrix(torch.randn(1500, 192), "int4")
    x = torch.randn(1, 192)
    expected = product(weight, x, 1)
    for pause in (0.0, 0.02, 0.0, 0.0, 0.01, 0.0):
        time.sleep(pause)
        for _ in range(20):
            assert torch.equal(product(weight, x, 2), expected)


def _products_on_one_core(queue):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # the helper, made here, shares the caller's core
    torch.manual_seed(5)
    weight = quantize_matrix(torch.randn(2048, 256), "int4")
    x = torch.randn(1, 256)
    expected = product(weight, x, 1)
    queue.put(all(torch.equal(product(weight, x, 2), expected) for _ in range(500)))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_two_threads_on_one_core_finish():
    """A helper that never gets a core of its own (taskset -c 0) must not make the caller wait for it."""
    assert in_forked_child(_products_on_one_core) is True


def test_kernels_get_the_callers_threads_inside_a_one_thread_forward():
    previous = torch.get_num_threads()
    seen = {}

    @thread_policy.on_one_thread
    def forward(budget: int):  # the budget travels explicitly (Products.threads)
        seen["torch"] = torch.get_num_threads()
        seen["small"] = thread_policy.kernel_threads(thread_policy.KERNEL_PARALLEL_MIN_WORK - 1, budget)
        seen["kernel"] = thread_policy.kernel_threads(thread_policy.KERNEL_PARALLEL_MIN_WORK, budget)
        seen["logits"] = thread_policy.kernel_threads(49152 * 576, budget)
        with thread_policy.threads_for(thread_policy.PARALLEL_MIN_WORK, budget):
            seen["big OpenMP op"] = torch.get_num_threads()
        seen["after"] = torch.get_num_threads()

    try:
        torch.set_num_threads(2)
        forward(torch.get_num_threads())
        assert seen == {"torch": 1, "small": 1, "kernel": 2, "logits": 2, "big OpenMP op": 2, "after": 1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_linear_on_two_threads_equals_one_thread_for_every_row_count(kind):
    """Through the policy: decode rows (the kernel) and prompt rows (decoded matrix + float GEMM)."""
    torch.manual_seed(3)
    weight = quantize_matrix(torch.randn(768, 512), kind)
    previous = torch.get_num_threads()
    try:
        for rows in (1, 8, 40):
            x = torch.randn(1, rows, 512)
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                products = Products.generated(torch.get_num_threads(), kernels=KernelChoice())
                results.append(thread_policy.on_one_thread(lambda: linear(x, weight, products=products))())
            assert results[0].shape == (1, rows, 768)
            assert torch.equal(results[0], results[1]), rows
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("activation", ["gelu", "gelu_new", "relu"])
def test_a_big_activation_gets_the_callers_threads_and_the_same_bits(activation, monkeypatch):
    """linear(..., activation) over an encoder-size output ([256, 3072]): the activation runs on the
    caller's threads (threads_for), a decode-size one ([8, 3072]) on one; the bits are the same."""
    torch.manual_seed(4)
    weight = quantize_matrix(torch.randn(3072, 768) * 0.05, "int8")
    bias = torch.randn(3072)
    seen = []
    real = thread_policy.threads_for

    def recording(work, budget):
        seen.append(work)
        return real(work, budget)

    monkeypatch.setattr("fastdecode.layers.gemm.threads_for", recording)
    previous = torch.get_num_threads()
    try:
        for rows, big in ((256, True), (8, False)):
            x = torch.randn(rows, 768)
            results = []
            for count in (1, 2):
                torch.set_num_threads(count)
                products = Products.generated(torch.get_num_threads(), kernels=KernelChoice())
                product = lambda: linear(x, weight, bias, activation, products=products)  # noqa: E731
                results.append(thread_policy.on_one_thread(product)())
            assert torch.equal(results[0], results[1]), rows
            assert (seen[-1] >= thread_policy.PARALLEL_MIN_WORK) == big
    finally:
        torch.set_num_threads(previous)
