"""``--prompt-rows int8-mlp|exact|int8`` on every command that loads a model: the choice reaches the loaded
model's products (layers/products.py's KernelChoice), and a bad value exits 2."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.layers import ops

pytest.importorskip("transformers")

COMMANDS = ["generate", "chat", "perplexity", "batch", "serve"]


def run(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("command", COMMANDS)
def test_every_model_command_offers_prompt_rows(command):
    result = run(command, "--help")
    assert result.exit_code == 0 and "--prompt-rows [int8-mlp|exact|int8]" in result.output


@pytest.mark.parametrize("command", COMMANDS)
def test_a_bad_prompt_rows_value_exits_2(command):
    result = run(command, "--prompt-rows", "fp8")
    assert result.exit_code == 2
    assert "--prompt-rows" in result.output and "'fp8' is not one of 'int8-mlp', 'exact', 'int8'" in result.output


@pytest.fixture
def exact_calls(monkeypatch) -> Counter:
    """Calls of the exact product (exact_qmatmul): what prompt rows of a quantized weight take under "exact"."""
    calls: Counter = Counter()
    real = ops.exact_qmatmul

    def counted(*args, **kwargs):
        calls["exact"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "exact_qmatmul", counted)
    return calls


@pytest.mark.skipif(not ops.available(), reason="the extension's kernels are not built here")
def test_generate_and_batch_hand_the_choice_to_the_model(tiny_folder, tmp_path, exact_calls):
    common = ["-m", tiny_folder, "--quantize", "int8", "--max-new-tokens", "3", "--no-chat"]
    result = run("generate", "-p", "w1 w2 w3 w4", *common, "--prompt-rows", "int8")
    assert result.exit_code == 0, result.output
    assert exact_calls["exact"] == 0
    result = run("generate", "-p", "w1 w2 w3 w4", *common, "--prompt-rows", "exact")
    assert result.exit_code == 0, result.output
    all_exact = exact_calls["exact"]
    assert all_exact > 0
    exact_calls.clear()
    result = run("generate", "-p", "w1 w2 w3 w4", *common)  # the default, int8-mlp: attention products exact
    assert result.exit_code == 0, result.output
    assert 0 < exact_calls["exact"] < all_exact
    exact_calls.clear()
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(3, 6)))
    result = run("batch", str(source), "-o", str(tmp_path / "out.jsonl"), *common, "--prompt-rows", "int8")
    assert result.exit_code == 0, result.output
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert exact_calls["exact"] == 0


def test_serve_loads_the_model_with_the_choice(tiny_folder, monkeypatch):
    from fastdecode.serve import server

    served = []
    monkeypatch.setattr(server, "run", lambda generator, *args, **kwargs: served.append(generator) or 0)
    result = run("serve", "-m", tiny_folder, "--prompt-rows", "int8")
    assert result.exit_code == 0, result.output
    assert served[0].model.kernels.prompt_rows == "int8"
