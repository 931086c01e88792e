"""Up to how many rows the float kernel reads w in place (layers/float_rows_choice.py): measured once per machine and
kernel build, kept in a file, read by later loads, carried by the model's KernelChoice into every float_matmul call;
the limits choose the speed, never the bits (the digests of tests/unit/test_float_kernel.py under forced limits)."""

from __future__ import annotations

import json

import pytest
import torch

from fastdecode.errors import InvalidOptionError
from fastdecode.layers import float_rows_choice, gemm_choice, kernels, ops
from fastdecode.layers.float_rows_choice import DEFAULT_IN_PLACE_ROWS, chosen_limit, machine_in_place_rows
from fastdecode.layers.linear import linear
from fastdecode.layers.products import KernelChoice, Products
from fastdecode.models.llama_decode import packed_product

needs_kernel = pytest.mark.skipif("not ops.available()", reason="no AVX2 extension on this machine")
# per layout, per timed row count: the time in place over the time packed
TIMES = {"spread": {16: 0.7, 32: 0.85, 48: 0.97, 64: 1.15}, "aliased": {16: 0.8, 32: 1.05, 48: 1.02, 64: 1.3}}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh cache folder, and a machine that has the AVX-512 kernel whatever this one has."""
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "available", lambda: True)
    monkeypatch.setattr(ops, "set_avx512", lambda enabled=None: True)
    return tmp_path


def test_the_limits_are_measured_once_then_read(cache_dir, monkeypatch):
    timings = iter([TIMES])
    monkeypatch.setattr(float_rows_choice, "time_in_place_rows", lambda: next(timings))  # a second measurement fails
    assert machine_in_place_rows() == (48, 32)
    path = float_rows_choice.limits_path()
    record = json.loads(path.read_text())
    assert path.parent == cache_dir and record["in_place_rows"] == [48, 32]
    assert record["in_place_over_packed"]["aliased"]["48"] == 1.02 and record["cpu"] == float_rows_choice.cpu_model()
    assert record["procedure"] == float_rows_choice.procedure()
    assert machine_in_place_rows() == (48, 32)  # read from the file: not measured again


@pytest.mark.parametrize("change", ["kernels", "cpu"])
def test_another_kernel_build_or_cpu_is_measured_again(cache_dir, monkeypatch, change):
    timings = iter([TIMES, {layout: {16: 2.0} for layout in TIMES}])
    monkeypatch.setattr(float_rows_choice, "time_in_place_rows", lambda: next(timings))
    assert machine_in_place_rows() == (48, 32)
    first = float_rows_choice.limits_path()
    if change == "kernels":  # a changed kernel source: another build folder (layers/kernels.py)
        monkeypatch.setattr(kernels, "library_path", lambda: cache_dir / "kernels-0123456789abcdef" / "lib.so")
    else:
        monkeypatch.setattr(gemm_choice, "cpu_model", lambda: "Intel(R) Xeon(R) Platinum 8481C")
    assert float_rows_choice.limits_path() != first and gemm_choice.choice_path() not in (None, first)
    assert machine_in_place_rows() == (8, 8)  # measured: packed wins at 16 rows
    assert json.loads(first.read_text())["in_place_rows"] == [48, 32]  # the first machine's record stays


@pytest.mark.parametrize(("limits", "procedure"), [
    (limits, procedure) for limits in ("[64, 32]", "[64, 65]", "[64.0, 32]", "[64]", '"(64, 32)"', None)
    for procedure in ("this", "another", None) if (limits, procedure) != ("[64, 32]", "this")])  # all but a valid one
def test_an_unreadable_or_invalid_record_is_measured_again(cache_dir, monkeypatch, limits, procedure):
    """Records cut short (limits None), with limits out of range or of another type, or made by another procedure
    (other row counts timed), or without one: measured again."""
    made = {"this": float_rows_choice.procedure(), "another": {**float_rows_choice.procedure(), "rows": [16, 32]}}
    record = json.dumps({"in_place_rows": limits and json.loads(limits), "procedure": made.get(procedure)})
    float_rows_choice.limits_path().write_text(record if limits else record[:-5])
    monkeypatch.setattr(float_rows_choice, "time_in_place_rows", lambda: TIMES)
    assert machine_in_place_rows() == (48, 32)
    assert json.loads(float_rows_choice.limits_path().read_text())["in_place_rows"] == [48, 32]


def test_without_the_avx512_kernel_nothing_is_measured(cache_dir, monkeypatch):
    monkeypatch.setattr(float_rows_choice, "time_in_place_rows", lambda: pytest.fail("nothing to measure"))
    monkeypatch.setattr(ops, "set_avx512", lambda enabled=None: False)
    assert machine_in_place_rows() == DEFAULT_IN_PLACE_ROWS
    monkeypatch.setattr(ops, "available", lambda: False)
    assert machine_in_place_rows() == DEFAULT_IN_PLACE_ROWS


def test_with_the_caches_off_every_load_measures(monkeypatch):
    monkeypatch.setenv("FASTDECODE_CACHE", "off")
    monkeypatch.setattr(ops, "available", lambda: True)
    monkeypatch.setattr(ops, "set_avx512", lambda enabled=None: True)
    calls = []
    monkeypatch.setattr(float_rows_choice, "time_in_place_rows", lambda: calls.append(1) or TIMES)
    assert float_rows_choice.limits_path() is None
    assert [machine_in_place_rows(), machine_in_place_rows()] == [(48, 32), (48, 32)] and len(calls) == 2


@pytest.mark.parametrize(("ratios", "default", "limit"), [
    ({16: 0.8, 32: 0.8, 48: 0.8, 64: 0.8}, 32, 64),  # in place wins everywhere
    ({16: 0.8, 32: 0.85, 48: 0.88, 64: 1.0}, 32, 48),  # clear wins past the default, then a near tie: packed
    ({16: 0.8, 32: 1.08, 48: 1.2, 64: 0.8}, 32, 32),  # a near tie up to the default: in place; then a clear loss
    ({16: 0.8, 32: 1.15, 48: 0.8, 64: 0.8}, 64, 16),  # the first clear loss ends it
    ({16: 1.15, 32: 0.8}, 64, 8),  # packed from 9 rows
])
def test_the_limit_is_the_last_row_count_in_place_wins_up_to(ratios, default, limit):
    assert chosen_limit(ratios, default) == limit


def test_the_measurement_times_both_paths_at_every_row_count():
    """The real measurement, on this machine (a fraction of a second): a positive ratio for each layout and row
    count, the thread count unchanged."""
    if not (ops.available() and ops.set_avx512()):
        pytest.skip("no AVX-512 float kernel on this machine")
    threads = torch.get_num_threads()
    ratios = float_rows_choice.time_in_place_rows()
    assert set(ratios) == set(float_rows_choice.SHAPES) and torch.get_num_threads() == threads
    for by_rows in ratios.values():
        assert set(by_rows) == set(float_rows_choice.ROWS) and all(ratio > 0 for ratio in by_rows.values())


def test_the_measurement_runs_on_the_cpu_whatever_the_default_device(monkeypatch):
    """As gemm_choice's: a user's ``torch.set_default_device`` ("cuda", "meta") must not reach the operands."""
    if not (ops.available() and ops.set_avx512()):
        pytest.skip("no AVX-512 float kernel on this machine")
    devices = set()
    run = ops.float_matmul
    monkeypatch.setattr(ops, "float_matmul", lambda x, w, *rest: devices.update({x.device.type, w.device.type})
                        or run(x, w, *rest))
    monkeypatch.setattr(float_rows_choice, "REPETITIONS", 1)
    monkeypatch.setattr(float_rows_choice, "ROWS", (16,))
    with torch.device("meta"):
        ratios = float_rows_choice.time_in_place_rows()
    assert devices == {"cpu"} and all(ratio > 0 for by_rows in ratios.values() for ratio in by_rows.values())


def test_the_kernel_choice_carries_the_machine_limits(monkeypatch):
    monkeypatch.setattr("fastdecode.layers.products.machine_float_choice", lambda: ("mkl", False))
    monkeypatch.setattr("fastdecode.layers.products.machine_in_place_rows", lambda: (48, 16))
    assert KernelChoice.at_load(None, None) == KernelChoice(prompt_rows="int8-mlp", float_gemm="mkl",
                                                            in_place_rows=(48, 16))
    assert KernelChoice().in_place_rows == DEFAULT_IN_PLACE_ROWS  # a reference choice: the defaults, nothing measured
    for bad in ((64,), (64, 7), (65, 32), [64, 32], (64, 32.0), (True, 32)):
        with pytest.raises(InvalidOptionError, match="in_place_rows"):
            KernelChoice(in_place_rows=bad)


@needs_kernel
def test_the_limits_are_passed_to_every_float_kernel_call_and_leave_the_bits(monkeypatch):
    """``linear`` (generated rows, prompt rows that take the kernel) and the fused decode blocks' products
    (models/llama_decode.py's ints) pass the choice's limits to float_matmul; any limits give the same bits."""
    g = torch.Generator().manual_seed(3)
    w, bias, x = torch.randn(96, 1024, generator=g), torch.randn(1024, generator=g), torch.randn(72, 96, generator=g)
    choices = [KernelChoice(in_place_rows=limits, prompt_kernel=True) for limits in [(8, 8), (64, 64), (24, 40)]]
    with torch.no_grad():
        for M in (9, 16, 24, 33, 40, 64, 72):
            outs = [linear(x[:M], w.t(), bias, products=Products.generated(2, kernels=choice)) for choice in choices]
            assert all(torch.equal(out, outs[0]) for out in outs), M
        passed = []
        op = ops.float_matmul
        monkeypatch.setattr(ops, "float_matmul", lambda *args: passed.append(args[4:]) or op(*args))
        for is_prompt, choice in zip((False, True), choices[1:]):
            linear(x[:40], w.t(), bias, products=Products.of_rows(is_prompt, 1, kernels=choice))
        assert passed == [(64, 64), (24, 40)]
    assert packed_product(w.t(), bias, choices[2]).ints == (0, 24, 40, 1024)
