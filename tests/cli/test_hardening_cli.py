"""Issue 10 (hardening), end to end through the CLI: batch files that cannot lose or poison a run,
closed or full standard streams, invalid UTF-8, absurd options. In-process (CliRunner) where
one process is enough; subprocesses for pipes, closed descriptors and a file-size limit."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from fastdecode.cli import main

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[2] / "src"
GENERATE = ("--max-new-tokens", "3", "--no-chat")


def run(*args: str, input: bytes | str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def batch(tiny_folder: str, source, out, *extra: str, input=None):
    return run("batch", str(source), "-o", str(out), "-m", tiny_folder, *GENERATE, "-q", *extra, input=input)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def subprocess_cli(*args: str, close: tuple[int, ...] = (), stdin=None, stdout=None, limit_file_size=None,
                   timeout: int = 120) -> subprocess.CompletedProcess:
    """`fastdecode ARGS` in a fresh interpreter, with some standard descriptors closed or limits set."""
    def prepare() -> None:
        for fd in close:
            os.close(fd)
        if limit_file_size is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    env = dict(os.environ, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", "from fastdecode.cli import main; main()", *args],
                          stdin=stdin, stdout=stdout if stdout is not None else subprocess.PIPE,
                          stderr=subprocess.PIPE, preexec_fn=prepare, env=env, timeout=timeout)


def test_poison_lines_bom_and_non_finite_ids_become_error_records(tiny_folder, tmp_path):
    """Cases 1, 3, 7: a 5000-digit id, 200,000-deep nesting, NaN / 1e999 ids, a lone surrogate:
    each is its line's error record and the run goes on; a BOM is stripped in every format."""
    lines = ['\ufeff{"prompt": "w5 w6", "id": "first"}',
             '{"id": ' + "9" * 5000 + ', "prompt": "x"}',
             "[" * 200_000 + "]" * 200_000,
             '{"id": 1e999, "prompt": "w5"}',
             '{"id": NaN, "prompt": "w6"}',
             '{"prompt": "w5 \\ud800"}',
             '{"prompt": "w7", "id": 2.5}']
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    result = batch(tiny_folder, source, out)
    assert result.exit_code == 1, result.output
    got = records(out)
    assert [r["line"] for r in got] == [1, 2, 3, 4, 5, 6, 7]
    assert got[0]["id"] == "first" and got[0]["prompt"] == "w5 w6" and "error" not in got[0]
    assert "digits" in got[1]["error"] and "nested too deeply" in got[2]["error"]
    assert "NaN or infinite" in got[3]["error"] and "NaN or infinite" in got[4]["error"]
    assert "not valid Unicode" in got[5]["error"]
    assert got[6]["id"] == 2.5 and "error" not in got[6]
    for line in out.read_text().splitlines():  # strict JSON: no NaN / Infinity constants anywhere
        json.loads(line, parse_constant=lambda constant: pytest.fail(f"{constant} in {line}"))
    # a rerun resumes the file (it is valid JSON throughout) and has nothing left to do
    again = batch(tiny_folder, source, out)
    assert again.exit_code == 1 and records(out) == got

    # BOM on stdin (sniffed as JSONL, not taken as text) and in a .txt file (not sent to the model)
    stdin_out, txt_out = tmp_path / "stdin.jsonl", tmp_path / "txt.jsonl"
    result = batch(tiny_folder, "-", stdin_out, input='\ufeff{"prompt": "w5 w6"}\n'.encode())
    assert result.exit_code == 0 and records(stdin_out)[0]["prompt"] == "w5 w6"
    txt = tmp_path / "in.txt"
    txt.write_bytes("\ufeffw5 w6\nw7\n".encode())
    assert batch(tiny_folder, txt, txt_out).exit_code == 0
    assert [r["prompt"] for r in records(txt_out)] == ["w5 w6", "w7"]
    assert records(txt_out)[0]["output"] == records(stdin_out)[0]["output"]


def test_pipes_and_fifos_are_read_once(tiny_folder, tmp_path):
    """Case 2: process substitution (a pipe's /dev/fd path) and a named FIFO are read exactly once."""
    read_end, write_end = os.pipe()
    os.write(write_end, b'{"prompt": "w5"}\n{"prompt": "w6"}\n')
    os.close(write_end)
    out = tmp_path / "pipe.jsonl"
    try:
        result = batch(tiny_folder, f"/dev/fd/{read_end}", out, "--input-format", "jsonl")
    finally:
        os.close(read_end)
    assert result.exit_code == 0, result.output
    assert [r["prompt"] for r in records(out)] == ["w5", "w6"]

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text('{"prompt": "w7"}\n'), daemon=True)
    writer.start()
    result = batch(tiny_folder, fifo, tmp_path / "fifo.jsonl", "--input-format", "jsonl")
    writer.join(timeout=30)
    assert result.exit_code == 0 and [r["prompt"] for r in records(tmp_path / "fifo.jsonl")] == ["w7"]


def test_output_is_locked_regular_and_never_the_input(tiny_folder, tmp_path):
    """Cases 4, 5, 8: a second run on a locked output exits 2 naming the holder; devices are
    refused; a hard link (or stdin) of the input is recognised by device and inode."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "w5"}\n')
    out = tmp_path / "out.jsonl"
    with open(out, "ab") as held:  # what a running batch process holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        result = batch(tiny_folder, source, out)
    assert result.exit_code == 2 and f"in use by process {os.getpid()}" in result.stderr
    assert "Traceback" not in result.output and out.read_bytes() == b""
    assert batch(tiny_folder, source, out).exit_code == 0  # the lock went with its holder
    to_stdout = batch(tiny_folder, source, "-")
    assert to_stdout.exit_code == 0 and json.loads(to_stdout.stdout) == records(out)[0]

    for device in ("/dev/zero", "/dev/full"):
        result = batch(tiny_folder, source, device)
        assert result.exit_code == 2 and "not a regular file" in result.stderr

    link = tmp_path / "link.jsonl"
    os.link(source, link)
    for extra in ((), ("--overwrite",)):
        result = batch(tiny_folder, source, link, *extra)
        assert result.exit_code == 2 and "is the input file" in result.stderr
    with open(source, "rb") as stdin:
        result = subprocess_cli("batch", "-", "-o", str(link), "-m", tiny_folder, *GENERATE, "--overwrite", stdin=stdin)
    assert result.returncode == 2 and b"is the input file" in result.stderr
    assert source.read_text() == '{"prompt": "w5"}\n'  # never emptied


def test_full_disk_is_one_clear_resumable_error(tiny_folder, tmp_path):
    """Case 6: a write error (here a file-size limit: EFBIG) is one line, exit 3, and the rerun resumes."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"w{5 + i} w{6 + i}\n" for i in range(8)))
    out = tmp_path / "out.jsonl"
    args = ("batch", str(source), "-o", str(out), "-m", tiny_folder, *GENERATE, "-q", "--batch-size", "2")
    result = subprocess_cli(*args, limit_file_size=300)
    assert result.returncode == 3, result.stderr
    message = result.stderr.decode().strip()
    assert message.count("\n") == 0 and "Traceback" not in message
    assert "File too large" in message and "rerun the same command to resume" in message
    resumed = subprocess_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert [r["line"] for r in records(out)] == list(range(1, 9))


def test_seeded_sampling_is_the_same_across_batch_sizes_and_resume(tiny_folder, tmp_path):
    """Case 9: each input's samples depend only on the seed and its line."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"w{5 + i} w{9 + 2 * i}\n" for i in range(10)))
    options = ("--do-sample", "--temperature", "1.5", "--seed", "7", "--max-new-tokens", "6")

    def sampled(name: str, *extra: str) -> list[dict]:
        result = run("batch", str(source), "-o", str(tmp_path / name), "-m", tiny_folder, "--no-chat", "-q", *options, *extra)
        assert result.exit_code == 0, result.output
        return records(tmp_path / name)

    reference = sampled("a.jsonl", "--batch-size", "3")
    assert sampled("b.jsonl", "--batch-size", "5", "--lookahead", "5") == reference
    partial = tmp_path / "c.jsonl"  # a killed run: 4 records and a torn fifth
    lines = (tmp_path / "a.jsonl").read_text().splitlines(keepends=True)
    partial.write_text("".join(lines[:4]) + lines[4][:20])
    assert sampled("c.jsonl", "--batch-size", "4") == reference
    assert len({r["output"] for r in reference}) > 5  # really sampled


def test_closed_and_full_standard_streams(tiny_folder, tmp_path):
    """Case 14: one line, exit 2 (a closed stream a command needs) or 1 (a write error), no traceback."""
    for args, fd, expected in ((("chat", "-m", tiny_folder), 0, "standard input is closed"),
                               (("perplexity", "-", "-m", tiny_folder), 0, "standard input is closed"),
                               (("batch", "-", "-o", str(tmp_path / "o.jsonl"), "-m", tiny_folder), 0,
                                "standard input is closed"),
                               (("generate", "-p", "w5", "-m", tiny_folder), 1, "standard output is closed")):
        result = subprocess_cli(*args, close=(fd,))
        message = result.stderr.decode().strip()
        assert result.returncode == 2 and message == f"error: {expected}" or message.startswith(
            f"error: {expected}"), (args, message)
    with open("/dev/full", "wb") as full:
        result = subprocess_cli("generate", "-p", "w5", "-m", tiny_folder, *GENERATE, stdout=full)
    message = result.stderr.decode().strip()
    assert result.returncode == 1 and message == "error: cannot write the output: No space left on device"


def test_invalid_utf8_absurd_options_and_a_chat_that_survives_a_bad_line(tiny_folder, tmp_path):
    """Cases 10, 12, 13 through the CLI."""
    result = subprocess_cli("generate", "-p", os.fsdecode(b"\xff\xfe\xc3("), "-m", tiny_folder, *GENERATE)
    assert result.returncode == 2 and b"not valid Unicode" in result.stderr and b"Traceback" not in result.stderr
    for args, message in ((("--do-sample", "--seed", "99999999999999999999999"), "seed must be an integer in"),
                          (("--repetition-penalty", "nan"), "repetition_penalty must be a finite number"),
                          (("--n-ctx", "100000000000"), "lower n_ctx (100000000000)"),
                          (("--num-beams", "4", "--max-memory", "1KB"), "lower num_beams (4)")):
        result = run("generate", "-p", "w5", "-m", tiny_folder, *GENERATE, *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)
    with open(tmp_path / "chat-input.txt", "wb") as handle:
        handle.write(b"w5 w6\n\xff\xfe bad\nw7\n")
    with open(tmp_path / "chat-input.txt", "rb") as stdin:
        result = subprocess_cli("chat", "-m", tiny_folder, "--max-new-tokens", "3", stdin=stdin)
    assert result.returncode == 0 and b"not valid Unicode" in result.stderr and b"Traceback" not in result.stderr
    assert result.stdout.count(b"> ") == 4 and result.stdout.count(b" w") >= 4  # replied before and after
