"""`fastdecode batch` and Generator.batch on a tiny random model: parity, formats, failures, kill -9 + resume."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fastdecode
from fastdecode.cli import main

pytest.importorskip("transformers")

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.fixture(scope="module")
def tiny_gen(tiny_folder):
    return fastdecode.load(tiny_folder)


def word_prompts(n: int, seed: int = 0, longest: int = 24) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, 150)}" for _ in range(rng.randint(1, longest))) for _ in range(n)]


def write_jsonl(path: Path, objects) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objects))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def test_batch_equals_generate_per_prompt(tiny_gen):
    """One engine, refilled as rows finish, reordered: every output is exactly what generate() gives
    for that prompt alone."""
    prompts = word_prompts(30, seed=1)
    free = tiny_gen.generate_ids([tiny_gen.encode_prompt(p) for p in prompts[:3]], max_new_tokens=10)
    options = dict(max_new_tokens=10, eos_token_id=sorted({free[0][1], free[2][1]}))  # some rows stop early
    records = list(tiny_gen.batch(prompts, batch_size=4, lookahead=12, **options))
    assert [r["id"] for r in records] == list(range(30))
    assert [r["output"] for r in records] == [tiny_gen.generate(p, **options) for p in prompts]
    singles = [tiny_gen.generate_ids_with_details([tiny_gen.encode_prompt(p)], **options)[0] for p in prompts]
    assert [(r["num_tokens"], r["finish_reason"]) for r in records] == [(len(s.tokens), s.finish_reason)
                                                                       for s in singles]
    assert {r["finish_reason"] for r in records} == {"eos", "length"}  # both paths exercised


def test_batch_of_seeded_samples_and_of_beams_equals_generate(tiny_gen):
    """Seeded sampling with several choices (each line seeded from its number) and beam search
    (which runs outside the engine) give what generate() gives for each prompt alone."""
    from fastdecode.decoding.sampling import derive_seed

    prompts = word_prompts(7, seed=2)
    sampled = dict(max_new_tokens=6, do_sample=True, num_return_sequences=2, top_k=20)
    records = list(tiny_gen.batch(prompts, batch_size=3, seed=9, **sampled))
    assert [r["output"] for r in records] == [tiny_gen.generate([p], seed=derive_seed(9, line), **sampled)
                                              for line, p in enumerate(prompts, 1)]
    beams = dict(max_new_tokens=5, num_beams=3)
    records = list(tiny_gen.batch(prompts, batch_size=3, **beams))
    assert [r["output"] for r in records] == [tiny_gen.generate(p, **beams) for p in prompts]


def test_cli_jsonl_with_failures_exit_1_and_fail_fast_exit_2(tiny_folder, tiny_gen, tmp_path):
    prompts = word_prompts(12, seed=2)
    lines = [json.dumps({"prompt": p, "id": f"q{i}"}) for i, p in enumerate(prompts)]
    lines[3] = "{not json"
    lines[5] = json.dumps({"id": "q5", "text": "w1"})
    lines[7] = json.dumps({"id": "q7", "prompt": " ".join(["w3"] * 300)})  # over the 256-token context
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines[:9]) + "\n\n" + "\n".join(lines[9:]) + "\n")  # a blank line 10
    out = tmp_path / "out.jsonl"
    result = run("batch", str(source), "-o", str(out), "-m", tiny_folder, "--max-new-tokens", "5", "--no-chat",
                 "--batch-size", "3")
    assert result.exit_code == 1, result.output
    records = read_jsonl(out)
    assert len(records) == 12
    failed = {r["line"]: r for r in records if "error" in r}
    assert set(failed) == {4, 6, 8}
    assert "id" not in failed[4] and "invalid JSON" in failed[4]["error"]
    assert failed[6]["id"] == "q5" and "missing field 'prompt'" in failed[6]["error"]
    assert failed[8]["id"] == "q7" and "context is 256" in failed[8]["error"]
    good = [r for r in records if "error" not in r]
    assert [r["line"] for r in good] == [1, 2, 3, 5, 7, 9, 11, 12, 13]  # line 10 is blank: not an input
    assert all(r["output"] == tiny_gen.generate(r["prompt"], max_new_tokens=5) for r in good)
    assert "3 failed" in result.stderr

    result = run("batch", str(source), "-o", str(tmp_path / "ff.jsonl"), "-m", tiny_folder, "--max-new-tokens", "5",
                 "--batch-size", "3", "--fail-fast", "-q")
    assert result.exit_code == 2
    assert "line 4: invalid JSON" in result.stderr and "Traceback" not in result.output
    assert [r["line"] for r in read_jsonl(tmp_path / "ff.jsonl")] == [1, 2, 3]  # everything before it


def test_cli_txt_stdin_field_and_progress(tiny_folder, tmp_path):
    prompts = word_prompts(6, seed=3)
    txt = tmp_path / "in.txt"
    txt.write_text("\n".join(prompts) + "\n")
    out_txt = tmp_path / "txt.jsonl"
    result = run("batch", str(txt), "-o", str(out_txt), "-m", tiny_folder, "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output
    assert "sample/s" in result.stderr and "6/6" in result.stderr  # tqdm: done/total, rate
    from_txt = read_jsonl(out_txt)
    assert [(r["id"], r["prompt"]) for r in from_txt] == list(enumerate(prompts))

    jsonl = "".join(json.dumps({"text": p}) + "\n" for p in prompts)
    out_stdin = tmp_path / "stdin.jsonl"
    result = run("batch", "-", "-o", str(out_stdin), "-m", tiny_folder, "--max-new-tokens", "4", "--field", "text",
                 "--quiet", input=jsonl)
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    assert [r["output"] for r in read_jsonl(out_stdin)] == [r["output"] for r in from_txt]

    out_plain = tmp_path / "plain.jsonl"
    result = run("batch", "-", "-o", str(out_plain), "-m", tiny_folder, "--max-new-tokens", "4", "-q",
                 input="\n".join(prompts))
    assert result.exit_code == 0 and [r["output"] for r in read_jsonl(out_plain)] == [r["output"] for r in from_txt]


def test_cli_num_return_sequences_gives_lists(tiny_folder, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": p} for p in word_prompts(3, seed=4)])
    out = tmp_path / "out.jsonl"
    result = run("batch", str(source), "-o", str(out), "-m", tiny_folder, "--max-new-tokens", "6", "--do-sample",
                 "--num-return-sequences", "3", "--seed", "1", "--max-batch-tokens", "200", "-q")
    assert result.exit_code == 0, result.output
    for record in read_jsonl(out):
        assert len(record["output"]) == len(record["num_tokens"]) == len(record["finish_reason"]) == 3
        assert all(isinstance(text, str) for text in record["output"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "4", "--max-batch-tokens", "100"], "not both"),
        (["--batch-size", "0"], "batch_size"),
        (["--num-return-sequences", "2"], "do_sample"),
        (["--temperature", "-1"], "temperature"),
    ],
)
def test_cli_bad_usage_exits_2(tiny_folder, tmp_path, extra, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "w1"}])
    result = run("batch", str(source), "-o", str(tmp_path / "out.jsonl"), "-m", tiny_folder, *extra)
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_cli_refuses_to_resume_an_output_of_another_input(tiny_folder, tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "w1", "id": "a"}, {"prompt": "w2", "id": "b"}])
    other = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "w1", "id": "x"}, {"prompt": "w2", "id": "y"}])
    out = tmp_path / "out.jsonl"
    assert run("batch", str(first), "-o", str(out), "-m", tiny_folder, "--max-new-tokens", "2", "-q").exit_code == 0
    result = run("batch", str(other), "-o", str(out), "-m", tiny_folder, "--max-new-tokens", "2", "-q")
    assert result.exit_code == 2 and "does not match" in result.stderr
    result = run("batch", str(other), "-o", str(out), "-m", tiny_folder, "--max-new-tokens", "2", "-q", "--overwrite")
    assert result.exit_code == 0 and [r["id"] for r in read_jsonl(out)] == ["x", "y"]


def test_kill_9_mid_run_then_restart_writes_every_input_exactly_once(tiny_folder, tmp_path):
    """Kill -9 while the run is busy, add a torn line as a kill inside a write would, restart the
    same command: every input is in the output exactly once, in order.

    The first run reads stdin from this test, which feeds half the input and keeps the pipe open:
    the run cannot finish before the kill, however loaded the machine is.
    """
    n = 200
    lines = [json.dumps({"prompt": p, "id": f"q{i}"}) + "\n" for i, p in enumerate(word_prompts(n, seed=5, longest=12))]
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "fastdecode.cli", "batch", "-", "-o", str(out), "-m", tiny_folder,
               "--max-new-tokens", "8", "--batch-size", "2", "--lookahead", "4", "--no-chat", "-q"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    try:
        process.stdin.write("".join(lines[: n // 2]).encode())
        process.stdin.flush()
        deadline = time.time() + 60
        while time.time() < deadline and process.poll() is None:
            if out.exists() and out.read_bytes().count(b"\n") >= 10:
                break
            time.sleep(0.005)
        assert process.poll() is None, process.stderr.read().decode()
    finally:
        process.kill()  # SIGKILL: no cleanup, no flush, no goodbye
        process.wait()
    partial = out.read_bytes()
    assert 10 <= partial.count(b"\n") < n // 2 + 1
    with open(out, "ab") as handle:
        handle.write(b'{"id": "q999", "line": 9')

    restart = subprocess.run(command, env=env, input="".join(lines).encode(), capture_output=True, timeout=120)
    assert restart.returncode == 0, restart.stderr.decode()
    records = read_jsonl(out)
    assert [r["id"] for r in records] == [f"q{i}" for i in range(n)]  # each exactly once, in order
    assert out.read_bytes().startswith(partial)  # what was written before the kill is kept as is
