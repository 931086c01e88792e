"""The float32 GEMM of prompt rows, chosen per machine (layers/gemm_choice.py): measured once and kept
in a file, read by later loads; carried by the model's KernelChoice; both GEMMs give the same
products to float32 rounding, with and without a fused activation."""

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
    monkeypatch.setenv("FASTDECODE_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "onednn_available", lambda: True)
    return tmp_path


def test_the_faster_gemm_is_measured_once_then_read(cache_dir, monkeypatch):
    timings = iter([{"onednn": 0.2, "mkl": 0.1}])
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: next(timings))  # a second measurement fails
    assert gemm_choice.machine_float_gemm() == "mkl"
    record = json.loads(gemm_choice.choice_path().read_text())
    assert record["float_gemm"] == "mkl" and record["cpu"] == gemm_choice.cpu_model()
    assert gemm_choice.choice_path().parent == cache_dir
    assert gemm_choice.machine_float_gemm() == "mkl"  # read from the file: not measured again


def test_an_unreadable_record_is_measured_again(cache_dir, monkeypatch):
    gemm_choice.choice_path().write_text('{"float_gemm": "cuBLAS"')  # cut short, and not a choice
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"onednn": 0.1, "mkl": 0.3})
    assert gemm_choice.machine_float_gemm() == "onednn"
    assert json.loads(gemm_choice.choice_path().read_text())["float_gemm"] == "onednn"


def test_without_onednn_it_is_mkl(cache_dir, monkeypatch):
    monkeypatch.setattr(ops, "onednn_available", lambda: False)
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: pytest.fail("nothing to measure"))
    assert gemm_choice.machine_float_gemm() == "mkl"


def test_the_measurement_times_both_on_one_thread():
    if not ops.onednn_available():
        pytest.skip("no oneDNN GEMM in this PyTorch")
    threads = torch.get_num_threads()
    timings = gemm_choice.time_float_gemms()
    assert set(timings) == {"onednn", "mkl"} and all(t > 0 for t in timings.values())
    assert torch.get_num_threads() == threads  # restored


def test_a_load_carries_the_machine_choice(cache_dir, monkeypatch):
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: {"onednn": 0.3, "mkl": 0.1})
    assert KernelChoice.at_load(None, None).float_gemm == "mkl"
    assert KernelChoice.at_load("int8", None) == KernelChoice(prompt_rows="int8", float_gemm="mkl")
    explicit = KernelChoice(float_gemm="onednn")
    assert KernelChoice.at_load(None, explicit) is explicit  # a reference run's choice is kept as given
    with pytest.raises(InvalidOptionError, match="float_gemm must be one of onednn, mkl"):
        KernelChoice(float_gemm="blas")


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


def test_a_model_gives_the_same_answer_on_either_gemm(tmp_path):
    from tiny_models import save_tiny_folder

    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False)
    prompts = [[5, 9, 31, 7, 64, 3, 18], [11, 2, 40]]
    runs = {}
    for float_gemm in ("onednn", "mkl"):
        gen = fastdecode.load(str(tmp_path), kernels=KernelChoice(float_gemm=float_gemm))
        assert gen.model.kernels.float_gemm == float_gemm
        runs[float_gemm] = gen.generate_ids(prompts, max_new_tokens=8)
    assert runs["onednn"] == runs["mkl"]


def test_with_the_caches_off_it_measures_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FASTDECODE_CACHE", "off")
    monkeypatch.setattr(ops, "onednn_available", lambda: True)
    timings = iter([{"onednn": 0.2, "mkl": 0.1}, {"onednn": 0.1, "mkl": 0.2}])
    monkeypatch.setattr(gemm_choice, "time_float_gemms", lambda: next(timings))
    assert gemm_choice.choice_path() is None
    assert [gemm_choice.machine_float_gemm(), gemm_choice.machine_float_gemm()] == ["mkl", "onednn"]  # measured twice
    assert list(tmp_path.iterdir()) == []
