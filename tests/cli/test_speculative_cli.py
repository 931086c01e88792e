"""`--speculative` on the command line: the same text as without (the CLI as a subprocess), and
exit 2 with a message for combinations that cannot speculate."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from fastdecode.cli import main

pytest.importorskip("transformers")


def _generate(folder: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastdecode.cli", "generate", "-m", folder, "-p", "w3 w5 w3 w5 w3 w5 w3",
                           "--max-new-tokens", "12", *flags], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


def test_speculative_flag_gives_the_same_text(tiny_folder):
    plain = CliRunner().invoke(main, ["generate", "-m", tiny_folder, "-p", "w3 w5 w3 w5 w3 w5 w3",
                                      "--max-new-tokens", "12"])
    speculating = _generate(tiny_folder, "--speculative", "ngram", "--speculative-tokens", "4")
    assert plain.exit_code == speculating.returncode == 0, speculating.stderr
    assert speculating.stdout == plain.stdout


@pytest.mark.parametrize("flags, message", [
    (["--speculative-tokens", "3"], "--speculative ngram"),
    (["--speculative", "ngram", "--draft-model", "x.gguf"], "not both"),
    (["--draft-model", "/no/such/model"], "does not exist"),
    (["--speculative", "ngram", "--num-beams", "2"], "beam search"),
    (["--speculative", "ngram", "--speculative-tokens", "0"], "num_tokens"),
    (["--speculative", "ngram", "--no-cache"], "use_cache"),
])
def test_speculative_flags_that_cannot_run_exit_2(tiny_folder, flags, message):
    result = CliRunner().invoke(main, ["generate", "-m", tiny_folder, "-p", "w1 w2", "--max-new-tokens", "4", *flags])
    assert result.exit_code == 2, result.output
    assert message in result.stderr and "Traceback" not in result.output
