"""Issue 28 (hardening, round two), the CLI rows, each through the CLI as a subprocess: a closed
pipe on stdout, a chat on a model without a chat template, UTF-16 / UTF-32 batch inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from test_hardening_cli import GENERATE, SRC, batch, records, subprocess_cli

pytest.importorskip("transformers")


def test_a_closed_pipe_is_a_quiet_exit_for_every_command_that_writes_stdout(tiny_folder, tmp_path):
    """Row 6: `... | head -1` where the reader is gone before the first write: SIGPIPE's status, nothing on stderr."""
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\nw7\n")
    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    for args in (("generate", "-p", "w5 w6", "-m", tiny_folder, *GENERATE),
                 ("batch", str(source), "-o", "-", "-m", tiny_folder, *GENERATE, "-q"),
                 ("inspect", tiny_folder)):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader has already gone
        try:
            result = subprocess.run([sys.executable, "-c", "from fastdecode.cli import main; main()", *args],
                                    stdout=write_end, stderr=subprocess.PIPE, env=env, timeout=120)
        finally:
            os.close(write_end)
        assert (result.returncode, result.stderr) == (128 + signal.SIGPIPE, b""), args


def test_chat_refuses_a_model_without_a_chat_template_at_start(tmp_path):
    """Row 7: exit 2 before the first prompt, naming what to change; no prompt is shown."""
    from tiny_models import save_tiny_folder, save_word_tokenizer

    save_tiny_folder(tmp_path, with_tokenizer=False)
    save_word_tokenizer(tmp_path)  # a tokenizer without a chat template
    with open(os.devnull, "rb") as stdin:
        result = subprocess_cli("chat", "-m", str(tmp_path), "--max-new-tokens", "3", stdin=stdin)
    message = result.stderr.decode()
    assert result.returncode == 2 and "no chat template" in message and "--model" in message, message
    assert result.stdout == b"" and "Traceback" not in message


def test_batch_decodes_utf16_and_utf32_by_their_byte_order_mark(tiny_folder, tmp_path):
    """Row 8: a UTF-16 file (the BOM FF FE) through the CLI gives the UTF-8 file's records; UTF-16 BE and
    UTF-32 too; a prompt with NUL characters is an error record (never sent); a broken UTF-16 file is
    refused at once (exit 2) naming the encoding."""
    text = "w5 w6\nw7 w8\r\n\nw9\n"
    (tmp_path / "utf8.txt").write_text(text, encoding="utf-8")
    assert batch(tiny_folder, tmp_path / "utf8.txt", tmp_path / "utf8.jsonl").exit_code == 0
    expected = records(tmp_path / "utf8.jsonl")
    assert [r["prompt"] for r in expected] == ["w5 w6", "w7 w8", "w9"]
    (tmp_path / "utf16.txt").write_bytes(text.encode("utf-16"))  # FF FE + little-endian on this machine
    assert (tmp_path / "utf16.txt").read_bytes()[:2] == b"\xff\xfe"
    result = subprocess_cli("batch", str(tmp_path / "utf16.txt"), "-o", str(tmp_path / "utf16.jsonl"), "-m",
                            tiny_folder, *GENERATE, "-q")
    assert result.returncode == 0 and records(tmp_path / "utf16.jsonl") == expected, result.stderr
    for name, data in (("be.txt", b"\xfe\xff" + text.encode("utf-16-be")),
                       ("utf32.txt", text.encode("utf-32")), ("be32.txt", b"\0\0\xfe\xff" + text.encode("utf-32-be"))):
        (tmp_path / name).write_bytes(data)
        assert batch(tiny_folder, tmp_path / name, tmp_path / f"{name}.jsonl").exit_code == 0, name
        assert records(tmp_path / f"{name}.jsonl") == expected, name

    (tmp_path / "nul.jsonl").write_text(json.dumps({"prompt": "w5\u0000w6"}) + "\nw7\n".replace("w7", '{"prompt": "w7"}'))
    result = batch(tiny_folder, tmp_path / "nul.jsonl", tmp_path / "nul.out.jsonl")
    got = records(tmp_path / "nul.out.jsonl")
    assert result.exit_code == 1 and "NUL characters" in got[0]["error"] and "output" not in got[0]
    assert got[1]["prompt"] == "w7" and "output" in got[1]

    (tmp_path / "broken.txt").write_bytes(b"\xff\xfe" + "w5\n".encode("utf-16-le") + b"w")  # an odd byte count
    result = batch(tiny_folder, tmp_path / "broken.txt", tmp_path / "broken.jsonl")
    assert result.exit_code == 2 and "UTF-16" in result.output, result.output
