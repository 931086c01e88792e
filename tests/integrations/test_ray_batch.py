"""`fastdecode batch --ray` and fastdecode.integrations.ray on a local Ray (127.0.0.1, 2 actors x 1 CPU).

One Ray instance serves the whole module (starting one takes seconds); `--ray local` in this
process reuses it (a process already connected to Ray keeps its connection). Every Ray output is
compared byte for byte with the single-process `fastdecode batch` output of the same input.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import fastdecode.cli.batch_run as pipeline_cli
from fastdecode.cli import main
from fastdecode.pipeline.output import OutputFile

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pytest.importorskip("transformers")

from fastdecode.integrations.ray_batch import local_ray  # noqa: E402 - after the skip

ACTOR_TITLE = b"MapBatches(FastDecodePredictor)"  # in the process title Ray gives each actor's worker


@pytest.fixture(scope="module")
def ray_address():
    with local_ray(num_cpus=2) as address:
        yield address


def prompt_lines(n: int, start: int = 0) -> list[str]:
    return [json.dumps({"prompt": " ".join(f"w{3 + (i * 7 + k * 13) % 140}" for k in range(1 + i % 9)),
                        "id": f"q{i}"}) for i in range(start, start + n)]


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def run_both(source: Path, tmp_path: Path, *options: str) -> tuple[bytes, bytes]:
    """(single-process output, --ray output) of the same command, after checking their exit codes agree."""
    single = run("batch", str(source), "-o", str(tmp_path / "single.jsonl"), "-q", *options)
    on_ray = run("batch", str(source), "-o", str(tmp_path / "ray.jsonl"), "-q", "--ray", "local", "--actors", "2",
                 *options)
    assert on_ray.exit_code == single.exit_code, (on_ray.output, single.output)
    return (tmp_path / "single.jsonl").read_bytes(), (tmp_path / "ray.jsonl").read_bytes()


def test_encoded_rows_carry_items_exactly():
    """The driver -> actor encoding keeps ids and prompts of any JSON type, and odd strings."""
    from fastdecode.integrations.ray import decode_item, encode_items
    from fastdecode.pipeline.inputs import InputItem

    items = [InputItem(line=1, id=0, prompt="plain"), InputItem(line=3, id="x", prompt="lone \ud800 surrogate"),
             InputItem(line=4, id=[1, {"a": None}], prompt=[{"role": "user", "content": "hi"}]),
             InputItem(line=7, error="invalid JSON: ..."),
             InputItem(line=8, id=8, prompt="json", response_format={"type": "json_object"})]
    table = encode_items(items, first_seq=10)
    assert table.column("seq").to_pylist() == [10, 11, 12, 13, 14]
    assert [decode_item(row) for row in table.to_pylist()] == items


def test_ray_batch_sizes_and_bad_ray_options(tmp_path, tiny_folder):
    from fastdecode.integrations.ray import ray_batch_size

    assert ray_batch_size(None, 2, 128) == 128  # stdin: one window per Ray batch
    assert ray_batch_size(48, 2, 128) == 6  # 4 batches per actor
    assert ray_batch_size(100_000, 8, 128) == 128 and ray_batch_size(3, 2, 128) == 1
    source = tmp_path / "in.txt"
    source.write_text("w5 w6\n")
    result = run("batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--ray", "--actors", "0")
    assert result.exit_code == 2 and "--actors must be an integer >= 1" in result.stderr
    result = run("batch", str(source), "-o", str(tmp_path / "out.jsonl"), "--ray", "-m", str(tmp_path / "none"))
    assert result.exit_code == 2 and "does not exist" in result.stderr and "Traceback" not in result.output


def test_ray_output_equals_single_process_with_bad_rows(ray_address, tiny_folder, tmp_path):
    lines = prompt_lines(14)
    lines[2] = "{not json"
    lines[5] = json.dumps({"id": "q5", "text": "w1"})  # no prompt field
    lines[7] = json.dumps({"id": "q7", "prompt": " ".join(["w3"] * 300)})  # over the 256-token context
    lines[9] = json.dumps({"id": 9, "prompt": [{"role": "user", "content": "w4 w5"}]})  # chat messages, int id
    source = tmp_path / "in.jsonl"
    source.write_bytes(("\n".join(lines[:11]) + "\n\n" + "\n".join(lines[11:]) + "\n").encode()
                       + b"\xff\xfe bad utf-8\n")
    single, on_ray = run_both(source, tmp_path, "-m", tiny_folder, "--max-new-tokens", "6", "--batch-size", "3")
    assert on_ray == single
    records = [json.loads(line) for line in on_ray.splitlines()]
    assert [r["line"] for r in records] == [*range(1, 12), *range(13, 17)]  # input order; line 12 is blank
    assert {r["line"] for r in records if "error" in r} == {3, 6, 8, 16}
    assert records[9]["id"] == 9 and records[9]["num_tokens"] == 6


def actor_pids() -> set[int]:
    pids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if ACTOR_TITLE in cmdline:
                pids.add(int(entry))
    return pids


class InterruptedOutput(OutputFile):
    """Appends the first group of records, then Ctrl-C, as a user would interrupt the run."""

    def __call__(self, records):
        super().__call__(records)
        raise KeyboardInterrupt


def kill_one_actor_once_records_flow(out: Path, actors: int, killed: list) -> None:
    """kill -9 one actor's worker process as soon as every actor is up and the output grew.

    Actors of an earlier run may still be shutting down: only new worker processes count.
    """
    written_before = out.read_bytes().count(b"\n")
    earlier = actor_pids()
    deadline = time.time() + 120
    while time.time() < deadline:
        pids = actor_pids() - earlier
        written = out.read_bytes().count(b"\n")
        if len(pids) >= actors and written > written_before:
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            killed.append((victim, written))
            return
        time.sleep(0.01)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the actors' processes through /proc")
def test_interrupted_run_resumes_and_a_killed_actor_loses_nothing(ray_address, tiny_folder, tmp_path, monkeypatch):
    """Ctrl-C after the first records; then the same command resumes, and one actor's worker is
    killed with SIGKILL mid-run: Ray restarts it and re-runs its batch. The output is the
    single-process output, byte for byte: every input exactly once, in input order, and, sampled
    with a seed, the same samples (each input's seed comes from its line, not its batch)."""
    n = 48
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(prompt_lines(n)) + "\n")
    options = ["-m", tiny_folder, "--max-new-tokens", "12", "--batch-size", "2", "--no-chat", "--do-sample",
               "--seed", "7", "-q"]
    out = tmp_path / "ray.jsonl"
    command = ["batch", str(source), "-o", str(out), "--ray", "local", "--actors", "2", *options]

    with monkeypatch.context() as patch:
        patch.setattr(pipeline_cli, "OutputFile", InterruptedOutput)
        assert run(*command).exit_code == 130
    done = out.read_bytes().count(b"\n")
    assert 1 <= done < n // 2, done  # interrupted early: the resumed run has most of the work

    killed: list[tuple[int, int]] = []
    killer = threading.Thread(target=kill_one_actor_once_records_flow, args=(out, 2, killed))
    killer.start()
    resumed = run(*command[:-1])  # not quiet: the resume message
    killer.join()
    assert resumed.exit_code == 0, resumed.output
    assert f"resume: {done} inputs already in" in resumed.stderr
    assert killed and killed[0][1] < n, f"the run ended before an actor could be killed: {killed}"
    assert run("batch", str(source), "-o", str(tmp_path / "single.jsonl"), *options).exit_code == 0
    assert out.read_bytes() == (tmp_path / "single.jsonl").read_bytes()


def test_generate_dataset_on_plain_rows(ray_address, tiny_folder):
    from fastdecode import load
    from fastdecode.integrations.ray import generate_dataset

    rows = [{"prompt": "w5 w6 w7", "id": "a"}, {"prompt": "", "id": "b"}, {"prompt": "w9", "id": "c"}]
    ds = generate_dataset(ray.data.from_items(rows), tiny_folder, actors=2, max_new_tokens=4, chat=False)
    records = sorted(ds.take_all(), key=lambda record: record["id"])
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert records[1]["error"] == "empty prompt" and records[1]["output"] is None
    gen = load(tiny_folder)
    assert [r["output"] for r in (records[0], records[2])] == gen.generate(["w5 w6 w7", "w9"], max_new_tokens=4)
    assert records[0]["num_tokens"] == 4 and records[0]["finish_reason"] == "length"


@pytest.mark.slow
def test_embedded_model_on_ray_equals_single_process(ray_address, smollm_path, tmp_path):
    source = tmp_path / "in.txt"
    source.write_text("What is the capital of France?\nName a primary colour.\n\nCount to three.\n"
                      "Say hello in Spanish.\n")
    single, on_ray = run_both(source, tmp_path, "-m", str(smollm_path), "--max-new-tokens", "8", "--prompt-rows", "exact")
    assert on_ray == single
    records = [json.loads(line) for line in on_ray.splitlines()]
    assert [r["line"] for r in records] == [1, 2, 4, 5] and "Paris" in records[0]["output"]
