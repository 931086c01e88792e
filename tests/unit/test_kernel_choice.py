"""The kernel choice (layers/products.py's ``KernelChoice``; issue 30, "No hidden state"): made at load,
held by the model, carried by every forward's ``Products`` down to the products. No module switch
chooses arithmetic any more: tests choose by loading (or by handing products), never by patching."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT
from kquant_gguf import write_tiny_llama
from tiny_models import build, save_tiny_folder

import fastdecode
from fastdecode.errors import InvalidOptionError
from fastdecode.layers import ops
from fastdecode.layers.linear import linear
from fastdecode.layers.float_rows_choice import machine_in_place_rows
from fastdecode.layers.gemm_choice import machine_float_choice
from fastdecode.layers.products import KernelChoice, Products
from fastdecode.layers.quantized import QuantizedWeight, dequantize, in_mlp, quantize_matrix, quantized_linear

SRC = Path(__file__).resolve().parents[2] / "src" / "fastdecode"
INT8 = KernelChoice(prompt_rows="int8")
needs_kernels = pytest.mark.skipif(not ops.available(), reason="the extension's kernels are not built here")


def test_a_bad_choice_is_a_typed_error_before_anything_loads(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(InvalidOptionError, match="prompt_rows must be one of int8-mlp, exact, int8, got 'fp8'"):
        fastdecode.load(missing, prompt_rows="fp8")  # refused before the path is looked at
    with pytest.raises(InvalidOptionError, match="not both"):
        fastdecode.load(missing, prompt_rows="int8", kernels=KernelChoice())
    with pytest.raises(InvalidOptionError, match="kernels must be a KernelChoice"):
        fastdecode.load(missing, kernels="int8")
    with pytest.raises(InvalidOptionError, match="float_kernel must be True or False, got 'yes'"):
        KernelChoice(float_kernel="yes")
    with pytest.raises(TypeError, match="KernelChoice"):
        Products.prompt(1, kernels="int8")
    with pytest.raises(TypeError):
        Products.prompt(1)  # the choice is required: a caller cannot forget it


def test_the_choice_is_held_by_the_model_and_defaults_to_int8_mlp_prompt_rows(tmp_path):
    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    gemm, prompt_kernel = machine_float_choice()  # (layers/gemm_choice.py: this machine's float products)
    # (layers/float_rows_choice.py: this machine's in-place row limits for the float kernel)
    machine = {"float_gemm": gemm, "prompt_kernel": prompt_kernel, "in_place_rows": machine_in_place_rows()}
    assert fastdecode.load(str(tmp_path)).model.kernels == KernelChoice(prompt_rows="int8-mlp", **machine)
    assert fastdecode.load(str(tmp_path), prompt_rows="exact").model.kernels == KernelChoice(prompt_rows="exact",
                                                                                              **machine)
    assert fastdecode.load(str(tmp_path), prompt_rows="int8").model.kernels == KernelChoice(prompt_rows="int8",
                                                                                             **machine)
    off = KernelChoice(quantized_kernels=False, float_kernel=False)
    assert fastdecode.load(str(tmp_path), kernels=off).model.kernels is off
    hf = build("llama-gqa", intermediate_size=96)
    assert fastdecode.from_hf(hf, quantize="int8", prompt_rows="int8").model.kernels == KernelChoice(
        prompt_rows="int8", **machine)
    with pytest.raises(InvalidOptionError, match="prompt_rows"):
        fastdecode.from_hf(hf, prompt_rows="exactly")


@needs_kernels
def test_products_follow_the_choice_they_carry():
    """Prompt rows under "int8" are the decode kernel's rows (bit for bit: the arithmetic the kernel
    tests bound), under "exact" the exactly decoded weights'; with the quantized kernels off every row
    is the exact product; with the float kernel off generated rows of a float matrix take the GEMM."""
    torch.manual_seed(0)
    weight = quantize_matrix(torch.randn(64, 128), "int8")  # the tiled layout: int8 prompt rows on the decode kernel
    x = torch.randn(5, 128)
    int8_prompt = quantized_linear(x, weight, None, Products.prompt(1, kernels=INT8))
    assert torch.equal(int8_prompt, quantized_linear(x, weight, None, Products.generated(1, kernels=INT8)))
    exact_prompt = quantized_linear(x, weight, None, Products.prompt(1, kernels=KernelChoice()))
    assert not torch.equal(exact_prompt, int8_prompt)
    torch.testing.assert_close(exact_prompt, x @ dequantize(weight).T, atol=1e-4, rtol=0)
    off = KernelChoice(quantized_kernels=False)
    assert torch.equal(quantized_linear(x, weight, None, Products.generated(1, kernels=off)), exact_prompt)

    dense = torch.randn(128, 64).t()  # [out, in] view of a contiguous [in, out] buffer: the float kernel's
    gemm_rows = linear(x, dense, products=Products.prompt(1, kernels=KernelChoice()))
    no_float_kernel = KernelChoice(float_kernel=False)
    with torch.inference_mode():
        assert torch.equal(linear(x, dense, products=Products.generated(1, kernels=no_float_kernel)), gemm_rows)


@pytest.fixture
def kernel_calls(monkeypatch) -> Counter:
    """Calls of the quantized ops: "exact" (exact_qmatmul), "int8" (int8 activations: prompt_qmatmul,
    tiled_gemm, tiled_gated_gemm (a gated MLP's gate and up), or qmatmul with activation_bits 8), "float32
    activations" (qmatmul's logits-layer kernel)."""
    calls: Counter = Counter()
    real = {name: getattr(ops, name)
            for name in ("exact_qmatmul", "prompt_qmatmul", "qmatmul", "tiled_gemm", "tiled_gated_gemm")}

    def exact(*args, **kwargs):
        calls["exact"] += 1
        return real["exact_qmatmul"](*args, **kwargs)

    def prompt_gemm(*args, **kwargs):
        calls["int8"] += 1
        return real["prompt_qmatmul"](*args, **kwargs)

    def tiled_gemm(*args, **kwargs):
        calls["int8"] += 1
        return real["tiled_gemm"](*args, **kwargs)

    def tiled_gated_gemm(*args, **kwargs):
        calls["int8"] += 1
        return real["tiled_gated_gemm"](*args, **kwargs)

    def decode_kernel(*args, **kwargs):
        bits = args[7] if len(args) > 7 else kwargs.get("activation_bits", 8)
        calls["int8" if bits == 8 else "float32 activations"] += 1
        return real["qmatmul"](*args, **kwargs)

    monkeypatch.setattr(ops, "exact_qmatmul", exact)
    monkeypatch.setattr(ops, "prompt_qmatmul", prompt_gemm)
    monkeypatch.setattr(ops, "tiled_gemm", tiled_gemm)
    monkeypatch.setattr(ops, "tiled_gated_gemm", tiled_gated_gemm)
    monkeypatch.setattr(ops, "qmatmul", decode_kernel)
    return calls


@needs_kernels
@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_1], ids=lambda q: q.name)  # the prompt GEMM; the tiled kernel
def test_the_loaded_choice_reaches_every_product_of_an_engine_step(qtype, tmp_path, kernel_calls):
    """Scoring a text is all prompt rows, through the engine: a default load multiplies them exactly,
    a load with prompt_rows="int8" on int8 activations (Q6_K: layers/qprompt.cpp's GEMM), and nothing
    else tells them apart."""
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", qtype, tied=False)
    ids = torch.randint(0, 40, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    exact_nll = fastdecode.load(path, prompt_rows="exact").score(ids)
    assert kernel_calls["exact"] > 0 and kernel_calls["int8"] == 0
    assert kernel_calls["float32 activations"] > 0  # the logits layer: float32 activations under every choice
    exact_calls = kernel_calls["exact"]
    kernel_calls.clear()
    int8_nll = fastdecode.load(path, prompt_rows="int8").score(ids)
    assert kernel_calls["exact"] == 0 and kernel_calls["int8"] == exact_calls
    assert int8_nll != exact_nll
    assert max(abs(a - b) for a, b in zip(int8_nll, exact_nll)) < 0.1 * max(exact_nll)  # the same model, rounded
    kernel_calls.clear()
    mixed_nll = fastdecode.load(path).score(ids)  # the default, "int8-mlp": each block's gate/up and down on int8
    blocks = fastdecode.load(path).config.num_layers
    assert kernel_calls["int8"] == 2 * blocks and kernel_calls["exact"] == exact_calls - 2 * blocks
    assert mixed_nll not in (exact_nll, int8_nll)


@needs_kernels
def test_int8_mlp_rounds_the_prompt_rows_of_mlp_products_only():
    """Under "int8-mlp" a weight marked ``in_mlp`` multiplies prompt rows as "int8" does, bit for bit, and
    any other weight as "exact" does; generated rows are the decode kernel's under every choice."""
    torch.manual_seed(0)
    attention = quantize_matrix(torch.randn(64, 128), "int8")
    mlp = in_mlp(attention)
    x = torch.randn(5, 128)
    mixed = KernelChoice(prompt_rows="int8-mlp")
    for weight, like in ((mlp, INT8), (attention, KernelChoice(prompt_rows="exact"))):
        assert torch.equal(quantized_linear(x, weight, None, Products.prompt(1, kernels=mixed)),
                           quantized_linear(x, weight, None, Products.prompt(1, kernels=like)))
        assert torch.equal(quantized_linear(x, weight, None, Products.generated(1, kernels=mixed)),
                           quantized_linear(x, weight, None, Products.generated(1, kernels=INT8)))
    assert not torch.equal(quantized_linear(x, mlp, None, Products.prompt(1, kernels=mixed)),
                           quantized_linear(x, attention, None, Products.prompt(1, kernels=mixed)))


@pytest.mark.parametrize("qtype", [QT.Q6_K, QT.Q4_1], ids=lambda q: q.name)
def test_a_load_marks_every_mlp_matrix_and_nothing_else(qtype, tmp_path):
    path = write_tiny_llama(tmp_path / f"{qtype.name}.gguf", qtype, tied=False)
    weights = fastdecode.load(path).checkpoint.weights
    quantized = {name: w for name, w in weights.items() if isinstance(w, QuantizedWeight)}
    marked = sorted(name for name, w in quantized.items() if w.in_mlp)
    layers = fastdecode.load(path).config.num_layers
    assert marked == sorted(f"layers.{i}.{part}.weight" for i in range(layers) for part in ("down", "gate", "up"))
    assert len(quantized) > len(marked)  # Q/K/V, O and the head stay unmarked


def test_a_float_model_gives_the_same_tokens_under_either_prompt_rows_choice(tmp_path):
    """The prompt-rows choice is about quantized weights: a float model's arithmetic does not change."""
    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    prompts = [[5, 9, 3, 7, 11, 4], [8, 12, 6]]
    exact = fastdecode.load(str(tmp_path)).generate_ids(prompts, max_new_tokens=6, eos_token_id=[])
    assert fastdecode.load(str(tmp_path), prompt_rows="int8").generate_ids(
        prompts, max_new_tokens=6, eos_token_id=[]) == exact


@needs_kernels
def test_the_fused_decode_block_runs_only_under_the_choice_it_was_packed_for(tmp_path):
    save_tiny_folder(tmp_path, "llama-gqa", with_tokenizer=False, intermediate_size=96)
    model = fastdecode.load(str(tmp_path), quantize="int8").model
    assert model.fused_decode is not None

    def plan(kernels: KernelChoice) -> SimpleNamespace:  # what FusedDecode.step reads of a decode plan
        return SimpleNamespace(decode_operands=None, score_bias=None, products=Products.generated(1, kernels=kernels))

    x = torch.zeros(1, 1, model.config.hidden_size)
    with torch.inference_mode():
        assert model.fused_decode.step(plan(model.kernels), x) is not None
        assert model.fused_decode.step(plan(KernelChoice(quantized_kernels=False)), x) is None


def _module_switches(path: Path) -> list[str]:
    """Module-level bool constants and ``global`` statements of one source file (the shapes a module
    switch takes), as "line: statement"."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, bool):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    found += [f"{node.lineno}: global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)]
    return found


def test_no_module_switch_is_left_in_the_source():
    switches = [f"{path.relative_to(SRC)}:{found}" for path in sorted(SRC.rglob("*.py"))
                for found in _module_switches(path)]
    assert switches == []
    text = "\n".join(path.read_text(encoding="utf-8") for path in SRC.rglob("*.py"))
    for name in ("USE_KERNEL", "PROMPT_ROWS_EXACT", "USE_FLOAT_KERNEL", "INT8_SEQ2SEQ_ACTIVATIONS"):
        assert name not in text


def test_the_scan_finds_a_switch(tmp_path):
    """The scan above can fail: a module switch is found."""
    source = tmp_path / "switch.py"
    source.write_text("FAST = True\n\ndef flip():\n    global FAST\n    FAST = False\n")
    assert _module_switches(source) == ["1: FAST = True", "4: global FAST"]
