"""`fastdecode chat`, `perplexity` and `generate --endless` (streaming cache) from the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from fastdecode.cli import main

pytest.importorskip("transformers")


def run(*args: str, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def test_perplexity_plain_and_streaming(tiny_folder, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i % 50}" for i in range(120)))
    plain = json.loads(run("perplexity", str(text), "-m", tiny_folder, "--json").stdout)
    assert plain["tokens"] == 119 and plain["perplexity"] > 1
    for policy in ("shift", "reevaluate"):
        result = run("perplexity", str(text), "-m", tiny_folder, "--json", "--n-ctx", "32", "--policy", policy)
        assert result.exit_code == 0, result.output
        streamed = json.loads(result.stdout)
        assert streamed["tokens"] == 119 and streamed["n_ctx"] == 32
    human = run("perplexity", str(text), "-m", tiny_folder)
    assert "perplexity" in human.stdout


def test_perplexity_bad_input_exits_2(tiny_folder, tmp_path):
    assert run("perplexity", str(tmp_path / "missing.txt"), "-m", tiny_folder).exit_code == 2
    text = tmp_path / "short.txt"
    text.write_text("w1")
    result = run("perplexity", str(text), "-m", tiny_folder)
    assert result.exit_code == 2 and "at least two tokens" in result.stderr
    text.write_text("w1 w2 w3")
    result = run("perplexity", str(text), "-m", tiny_folder, "--n-ctx", "8", "--n-keep", "9")
    assert result.exit_code == 2 and "n_keep" in result.stderr


def test_chat_keeps_the_conversation_between_turns(tiny_folder):
    result = run("chat", "-m", tiny_folder, "--max-new-tokens", "4", "--n-ctx", "64", input="w1 w2\nw3\n/quit\n")
    assert result.exit_code == 0, result.output
    assert result.stdout.count(">") >= 2


def test_generate_streaming_flags(tiny_folder):
    result = run("generate", "-m", tiny_folder, "-p", "w1 w2", "--max-new-tokens", "40", "--n-ctx", "16",
                 "--n-keep", "2", "--n-discard", "3", "--policy", "reevaluate")
    assert result.exit_code == 0, result.output
    gpt2_like = run("generate", "-m", tiny_folder, "-p", "w1", "--n-ctx", "16", "--n-keep", "16")
    assert gpt2_like.exit_code == 2 and "n_keep" in gpt2_like.stderr


def test_endless_with_max_new_tokens_exits_2(tiny_folder):
    """--endless set max_new_tokens to None over the flag's value, silently."""
    result = run("generate", "-m", tiny_folder, "-p", "w1", "--endless", "--max-new-tokens", "5")
    assert result.exit_code == 2 and "--max-new-tokens does not apply" in result.stderr


@pytest.mark.parametrize("command, flags, named", [
    ("generate", ["--n-keep", "2"], "n_keep=2"), ("generate", ["--n-discard", "3"], "n_discard=3"),
    ("generate", ["--policy", "reevaluate"], "policy='reevaluate'"), ("perplexity", ["--n-keep", "8"], "n_keep=8"),
])
def test_streaming_flags_without_n_ctx_exit_2(tiny_folder, tmp_path, command, flags, named):
    """They shape a streaming cache; without --n-ctx there is none, and they were silently ignored."""
    text = tmp_path / "text.txt"
    text.write_text("w1 w2 w3")
    where = ["-p", "w1 w2"] if command == "generate" else [str(text)]
    result = run(command, *where, "-m", tiny_folder, "--max-new-tokens", "2", *flags) if command == "generate" \
        else run(command, *where, "-m", tiny_folder, *flags)
    assert result.exit_code == 2 and named in result.stderr and "n_ctx" in result.stderr


def test_endless_generation_stops_cleanly_on_ctrl_c(tiny_folder):
    command = [sys.executable, "-m", "fastdecode.cli", "generate", "-m", tiny_folder, "-p", "w1 w2", "--endless",
               "--n-ctx", "32", "--no-chat"]
    # Ctrl-C in a terminal: SIGINT with its default action, which Python turns into KeyboardInterrupt.
    # A test run started in the background (`cmd &` in a script) inherits SIGINT *ignored*, and Python
    # keeps an inherited ignore, so the child would never stop: give it the terminal's disposition.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = process.stdout.read(200)  # blocks until 200 bytes of endless output exist
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    rest, errors = process.communicate(timeout=60)
    assert len(first) == 200
    assert process.returncode == 0, errors.decode()
    assert b"Traceback" not in errors
