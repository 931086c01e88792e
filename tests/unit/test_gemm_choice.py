"""The float32 products of prompt rows, chosen per machine (layers/gemm_choice.py): the GEMM and whether
prompt rows take the float kernel, measured once and kept in a file, read by later loads; carried by the
model's KernelChoice; both GEMMs give the same products to float32 rounding, with and without a fused
activation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import fastdecode
from fastdecode.errors import InvalidOptionError
from fastdecode.layers import gemm_choice, ops
from fastdecode.layers.gemm import ACTIVATIONS, gemm
from fastdecode.layers.products import KernelChoice


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    ops.available()  # the kernels loaded from the real cache first: a file run alone does not rebuild them in tmp_path
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "onednn_available", lambda: True)
    # the float kernel's in-place row limits: layers/float_rows_choice.py's (tests/unit/test_float_rows_choice.py)
    monkeypatch.setattr("fastdecode.layers.products.machine_in_place_rows", lambda: KernelChoice().in_place_rows)
    return tmp_path


def test_the_faster_gemm_is_measured_once_then_read(cache_dir, monkeypatch):
    timings = iter([{"onednn": 0.2, "mkl": 0.1}])
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: next(timings))  # a second measurement fails
    assert gemm_choice.machine_float_choice() == ("mkl", False)
    record = json.loads(gemm_choice.choice_path().read_text())
    assert record["float_gemm"] == "mkl" and record["cpu"] == gemm_choice.cpu_model()
    assert gemm_choice.choice_path().parent == cache_dir
    assert gemm_choice.machine_float_choice() == ("mkl", False)  # read from the file: not measured again


@pytest.mark.parametrize(("kernel", "takes_prompts"), [(0.1, True), (0.109, True), (0.111, False), (None, False)])
def test_prompt_rows_take_the_kernel_within_the_margin_of_the_faster_gemm(cache_dir, monkeypatch, kernel,
                                                                           takes_prompts):
    timings = {"onednn": 0.1, "mkl": 0.3} | ({} if kernel is None else {"kernel": kernel})  # None: not built
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: timings)
    assert gemm_choice.machine_float_choice() == ("onednn", takes_prompts)
    assert json.loads(gemm_choice.choice_path().read_text())["prompt_kernel"] is takes_prompts
    assert KernelChoice.at_load(None, None) == KernelChoice(prompt_rows="int8-mlp", prompt_kernel=takes_prompts)


def test_another_kernel_build_is_measured_again(cache_dir, monkeypatch):
    """The kernel takes part in the measurement: a changed kernel source (another build folder) measures again."""
    timings = iter([{"onednn": 0.2, "mkl": 0.1, "kernel": 0.3}, {"onednn": 0.2, "mkl": 0.1, "kernel": 0.1}])
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: next(timings))
    assert gemm_choice.machine_float_choice() == ("mkl", False)
    monkeypatch.setattr("fastdecode.layers.kernels.library_path", lambda: cache_dir / "kernels-0123456789abcd" / "x.so")
    assert gemm_choice.machine_float_choice() == ("mkl", True)


def test_an_unreadable_record_is_measured_again(cache_dir, monkeypatch):
    gemm_choice.choice_path().write_text('{"float_gemm": "cuBLAS"')  # cut short, and not a choice
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"onednn": 0.1, "mkl": 0.3})
    assert gemm_choice.machine_float_choice() == ("onednn", False)
    assert json.loads(gemm_choice.choice_path().read_text())["float_gemm"] == "onednn"


def test_a_record_from_before_the_kernel_took_part_is_measured_again(cache_dir, monkeypatch):
    gemm_choice.choice_path().write_text('{"float_gemm": "onednn"}')  # no "prompt_kernel"
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"onednn": 0.1, "mkl": 0.3, "kernel": 0.1})
    assert gemm_choice.machine_float_choice() == ("onednn", True)


def test_without_onednn_and_the_kernel_it_is_mkl(cache_dir, monkeypatch):
    monkeypatch.setattr(ops, "onednn_available", lambda: False)
    monkeypatch.setattr(ops, "available", lambda: False)
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: pytest.fail("nothing to measure"))
    assert gemm_choice.machine_float_choice() == ("mkl", False)


def test_without_onednn_the_kernel_is_timed_against_mkl(cache_dir, monkeypatch):
    monkeypatch.setattr(ops, "onednn_available", lambda: False)
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"mkl": 0.2, "kernel": 0.1})
    assert gemm_choice.machine_float_choice() == ("mkl", True)


def test_the_measurement_times_each_on_one_thread():
    threads = torch.get_num_threads()
    timings = gemm_choice.time_float_gemms()
    expected = {"mkl"} | ({"onednn"} if ops.onednn_available() else set()) | ({"kernel"} if ops.available() else set())
    assert set(timings) == expected and all(t > 0 for t in timings.values())
    assert torch.get_num_threads() == threads  # restored


def test_a_load_carries_the_machine_choice(cache_dir, monkeypatch):
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"onednn": 0.3, "mkl": 0.1})
    assert KernelChoice.at_load(None, None).float_gemm == "mkl"
    assert KernelChoice.at_load("int8", None) == KernelChoice(prompt_rows="int8", float_gemm="mkl")
    explicit = KernelChoice(float_gemm="onednn")
    assert KernelChoice.at_load(None, explicit) is explicit  # a reference run's choice is kept as given
    with pytest.raises(InvalidOptionError, match="float_gemm must be one of onednn, mkl"):
        KernelChoice(float_gemm="blas")
    with pytest.raises(InvalidOptionError, match="prompt_kernel must be True or False"):
        KernelChoice(prompt_kernel=1)


@pytest.mark.parametrize("activation", [None, "gelu", "gelu_new", "relu", "silu"])
@pytest.mark.parametrize("float_gemm", ["onednn", "mkl"])
def test_both_gemms_give_the_product(activation, float_gemm):
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 48, generator=generator)  # [..., in]
    weight = torch.randn(48, 80, generator=generator).t()  # [out, in] view of an [in, out] buffer
    bias = torch.randn(80, generator=generator)
    expected = F.linear(x.double(), weight.double(), bias.double())
    expected = expected if activation is None else ACTIVATIONS[activation](expected)
    with torch.inference_mode():
        out = gemm(x, weight, bias, activation, 2, float_gemm)
    assert out.dtype == torch.float32 and out.shape == (2, 37, 80)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)


def test_a_model_gives_the_same_answer_on_either_gemm_and_on_the_kernel(tmp_path):
    """The same greedy tokens whichever product prompt rows take; on the kernel a prompt's logits are the
    bits of the prompt alone, batched with another or not (each row's result depends only on the row)."""
    from tiny_models import save_tiny_folder

    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False)
    prompts = [[5, 9, 31, 7, 64, 3, 18], [11, 2, 40]]
    runs = {}
    for name, choice in [("onednn", KernelChoice(float_gemm="onednn")), ("mkl", KernelChoice(float_gemm="mkl")),
                         ("kernel", KernelChoice(prompt_kernel=True))]:
        gen = fastdecode.load(str(tmp_path), kernels=choice)
        assert gen.model.kernels == choice
        runs[name] = gen.generate_ids(prompts, max_new_tokens=8)
    assert runs["onednn"] == runs["mkl"] == runs["kernel"]
    if ops.available():  # gen: the kernel's
        engine = gen.engine()
        together = [engine.submit_scoring(prompt) for prompt in prompts]  # both prompts in one step
        while engine.has_work():
            engine.step()
        for prompt, sequence in zip(prompts, together):
            assert sequence.logprobs == [-nll for nll in gen.score(prompt)]  # alone


def test_with_the_caches_off_it_measures_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FASTDECODE_CACHE", "off")
    monkeypatch.setattr(ops, "onednn_available", lambda: True)
    timings = iter([{"onednn": 0.2, "mkl": 0.1}, {"onednn": 0.1, "mkl": 0.2}])
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: next(timings))
    assert gemm_choice.choice_path() is None
    assert [gemm_choice.machine_float_choice()[0], gemm_choice.machine_float_choice()[0]] == ["mkl", "onednn"]  # twice
    assert list(tmp_path.iterdir()) == []


def test_the_measurement_runs_on_the_cpu_whatever_the_default_device(monkeypatch):
    """A user's ``torch.set_default_device("cuda")`` (found on an H100: every load in the GPU parity suite
    failed on the CPU generator) or "meta" (empty operations timed, and that choice cached) must not reach
    the measured operands."""
    devices = set()

    def spy(run):
        def wrapped(x, weight, *rest):
            devices.update({x.device.type, weight.device.type})
            return run(x, weight, *rest)
        return wrapped

    monkeypatch.setattr(ops, "float_matmul", spy(ops.float_matmul))
    monkeypatch.setattr(ops, "onednn_linear", spy(ops.onednn_linear))
    monkeypatch.setattr(gemm_choice, "REPETITIONS", 1)
    monkeypatch.setattr(gemm_choice, "SHAPES", gemm_choice.SHAPES[:1])
    with torch.device("meta"):
        timings = gemm_choice.time_float_gemms()
    assert devices == {"cpu"} and all(seconds > 0 for seconds in timings.values())
