"""The `fastdecode` command line: end to end, and exit code 2 with a message for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdecode.cli import main

pytest.importorskip("transformers")


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_generate_streams_text_and_stats(tiny_folder):
    result = run("generate", "--model", tiny_folder, "--prompt", "w1 w2 w3", "--max-new-tokens", "6", "--stats")
    assert result.exit_code == 0, result.output
    assert "w" in result.stdout
    assert "tokens/s" in result.stderr and "6 new tokens" in result.stderr


def test_generate_with_chat_sampling_and_stop(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", "w4", "--chat", "--do-sample", "--temperature", "0.8",
                 "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "5", "--stop", "w9")
    assert result.exit_code == 0, result.output
    again = run("generate", "-m", tiny_folder, "-p", "w4", "--chat", "--do-sample", "--temperature", "0.8",
                "--top-k", "20", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "5", "--stop", "w9")
    assert again.stdout == result.stdout  # seeded: reproducible


def test_no_cache_gives_the_same_text(tiny_folder):
    cached = run("generate", "-m", tiny_folder, "-p", "w7 w8", "--max-new-tokens", "8")
    naive = run("generate", "-m", tiny_folder, "-p", "w7 w8", "--max-new-tokens", "8", "--no-cache")
    assert cached.exit_code == naive.exit_code == 0
    assert cached.stdout == naive.stdout


def test_inspect_table_and_json(tiny_folder):
    result = run("inspect", tiny_folder)
    assert result.exit_code == 0, result.output
    for needle in ("LlamaForCausalLM", "GQA", "kv cache bytes per token", "rope", "context length"):
        assert needle in result.stdout
    info = json.loads(run("inspect", tiny_folder, "--json").stdout)
    assert (info["heads"], info["kv_heads"], info["attention"]) == (4, 2, "GQA")
    assert info["kv_cache_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "-m", "/no/such/model", "-p", "hi"], "does not exist"),
        (["inspect", "/no/such/model"], "does not exist"),
        (["generate", "-p", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "-p", "hi", "--top-p", "2"], "top_p"),
        (["generate", "-p", "hi", "--max-new-tokens", "-1"], "max_new_tokens"),
        (["generate", "-p", "hi", "--num-beams", "0"], "num_beams"),
        (["generate", "-p", "hi", "--num-beams", "2", "--num-return-sequences", "3"], "num_return_sequences"),
        (["generate", "-p", "hi", "--no-repeat-ngram-size", "-1"], "no_repeat_ngram_size"),
        (["generate", "-p", "hi", "--num-beams", "2", "--do-sample"], "beam sampling"),
        # sampling flags without --do-sample: greedy decoding ignored them, silently
        (["generate", "-p", "hi", "--temperature", "0.5"], "temperature=0.5 shapes sampling"),
        (["generate", "-p", "hi", "--seed", "3", "--top-k", "5"], "top_k=5, seed=3 shape sampling"),
        (["batch", "-", "-o", "-", "--top-p", "0.9"], "top_p=0.9 shapes sampling"),
        (["chat", "--seed", "3"], "add --do-sample"),
    ],
)
def test_bad_input_exits_2_with_message(args, message):
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_bad_checkpoints_exit_2(tiny_folder, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("inspect", str(tmp_path / "empty"))
    assert result.exit_code == 2 and "no config.json" in result.stderr

    broken = tmp_path / "broken"
    broken.mkdir()
    for path in Path(tiny_folder).iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = run("generate", "-m", str(broken), "-p", "w1")
    assert result.exit_code == 2 and "model.safetensors" in result.stderr

    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["T5WithLMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    result = run("inspect", str(broken))
    assert result.exit_code == 2 and "supported architectures" in result.stderr


def test_help_and_inspect_list_the_supported_architectures():
    from fastdecode.models.registry import FAMILIES

    names = [a for family in FAMILIES for a in family.hf_architectures]
    gguf_names = [a for family in FAMILIES for a in family.gguf_architectures]
    for args in (["--help"], ["inspect", "--help"]):
        result = run(*args)
        text = " ".join(result.output.split())  # click wraps the epilog
        assert result.exit_code == 0 and all(name in text for name in names + gguf_names), args
    listing = json.loads(run("inspect", "--supported", "--json").output)
    assert listing == {"architectures": names, "gguf_architectures": gguf_names}


def test_prompt_too_long_exits_2(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", " ".join(["w1"] * 300), "--max-new-tokens", "4")
    assert result.exit_code == 2 and "context is 256" in result.stderr


def test_python_dash_m_fastdecode_is_the_command():
    """`python -m fastdecode ...` (it answered "No module named fastdecode.__main__")."""
    result = subprocess.run([sys.executable, "-m", "fastdecode", "inspect", "--supported"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "LlamaForCausalLM" in result.stdout, result.stderr


@pytest.mark.slow
def test_console_script_answers_on_the_embedded_model(smollm_path):
    """The README's main job (``make demo``), as a user runs it: a real process, the default model, streamed, its
    prompt multiplied exactly (the question's first token is a near tie that the default int8 MLP flips:
    tests/golden/test_embedded_model.py)."""
    script = Path(sys.executable).with_name("fastdecode")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "fastdecode.cli"]
    result = subprocess.run(
        command + ["generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "24", "--stats",
                   "--prompt-rows", "exact"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stderr


def test_generate_with_beam_search(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", "w1 w2", "--no-chat", "--num-beams", "3",
                 "--num-return-sequences", "2", "--length-penalty", "2.0", "--no-repeat-ngram-size", "2",
                 "--early-stopping", "never", "--max-new-tokens", "5", "--stats")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("--- ") == 2 and "score -" in result.stdout
    assert "2 sequences" in result.stderr


def test_greedy_with_no_repeat_ngram_flag(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", "w1 w2", "--no-chat", "--no-repeat-ngram-size", "1",
                 "--max-new-tokens", "8")
    assert result.exit_code == 0, result.output
    words = result.stdout.split()
    assert len(words) == len(set(words))  # n = 1: no token twice


def test_quantize_option_and_inspect_weight_groups(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", "w1 w2", "--max-new-tokens", "4", "--quantize", "int8")
    assert result.exit_code == 0, result.output
    table = run("inspect", tiny_folder, "--quantize", "int8")
    assert table.exit_code == 0, table.output
    assert "bytes read/token" in table.stdout and "int8" in table.stdout
    info = json.loads(run("inspect", tiny_folder, "--quantize", "int8", "--json").stdout)
    groups = {row["group"]: row for row in info["weight_groups"]}
    assert groups["layers.*.q.weight"]["type"] == "int8"
    assert groups["layers.*.attn_norm.weight"]["type"] == "float32"
    bad = run("generate", "-m", tiny_folder, "-p", "w1", "--quantize", "int3")
    assert bad.exit_code == 2
