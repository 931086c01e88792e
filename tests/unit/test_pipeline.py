"""The batch pipeline with a fake engine: bucketing, order, bounded memory, overlap, failures, resume files."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest

from fastdecode.errors import BatchFileError, InvalidOptionError, PromptTooLongError
from fastdecode.generation.decode import SequenceResult
from fastdecode.pipeline import BatchRun, BatchSettings, InputItem, items_from_lines, items_from_objects
from fastdecode.pipeline.batching import padding_share, plan_window
from fastdecode.pipeline.inputs import format_for, parse_json_line, skip_done
from fastdecode.pipeline.output import cut_torn_tail, prepare_output
from fastdecode.pipeline.records import ReorderBuffer


class FakeEngine:
    """Stands in for Generator: one token per prompt character; output is a pure function of the prompt.

    ``batch_s`` / ``decode_s`` sleep per batch / per result (sleep releases the GIL as real
    kernels and I/O do), to give each stage a known cost.
    """

    def __init__(self, batch_s: float = 0.0, decode_s: float = 0.0, max_prompt: int | None = None):
        self.batch_s, self.decode_s, self.max_prompt = batch_s, decode_s, max_prompt
        self.batches: list[list[list[int]]] = []
        self.threads: set[str] = set()

    def encode_prompt(self, prompt, chat=False):
        return [ord(c) for c in prompt]

    def generate_ids_with_details(self, prompts, num_return_sequences=1, **options):
        self.threads.add(threading.current_thread().name)
        for index, prompt in enumerate(prompts):
            if self.max_prompt is not None and len(prompt) > self.max_prompt:
                raise PromptTooLongError(f"prompt {index} has {len(prompt)} tokens")
        self.batches.append([list(p) for p in prompts])
        time.sleep(self.batch_s)
        return [SequenceResult([sum(p) % 1000, r], "length") for p in prompts for r in range(num_return_sequences)]

    def decode_results(self, results, **options):
        time.sleep(self.decode_s * len(results))
        return [f"out-{r.tokens[0]}-{r.tokens[1]}" for r in results]


def expected_output(prompt: str, r: int = 0) -> str:
    return f"out-{sum(ord(c) for c in prompt) % 1000}-{r}"


def make_items(prompts):
    return items_from_objects(prompts)


# -- pure pieces -------------------------------------------------------------------------------
def tokenized(lengths):
    return [InputItem(line=i + 1, seq=i, ids=[7] * n) for i, n in enumerate(lengths)]


def test_plan_window_buckets_by_length_and_orders_batches_by_oldest_input():
    rng = random.Random(0)
    items = tokenized([rng.randint(1, 60) for _ in range(64)])
    batches = plan_window(items, batch_size=8, max_batch_tokens=None)
    assert sorted(i.seq for b in batches for i in b) == list(range(64))
    assert all(len(b) == 8 for b in batches)
    assert [min(i.seq for i in b) for b in batches] == sorted(min(i.seq for i in b) for b in batches)
    unsorted = [items[k:k + 8] for k in range(0, 64, 8)]
    assert padding_share(batches) < padding_share(unsorted) / 3


def test_plan_window_token_budget_and_oversized_items_run_alone():
    items = tokenized([3, 4, 5, 40, 2])
    batches = plan_window(items, None, max_batch_tokens=30, rows_per_prompt=2, max_new_tokens=2)
    # budget = rows * r * (longest prompt + new tokens): [2, 3] -> 2*2*5 = 20 fits, + 4 -> 3*2*6 = 36 does not;
    # [4, 5] -> 2*2*7 = 28 fits; 40 alone is over budget and runs alone. Batches ordered by oldest input.
    assert [[len(i.ids) for i in b] for b in batches] == [[2, 3], [4, 5], [40]]
    with pytest.raises(ValueError):
        plan_window(items, 4, 30)


def test_reorder_buffer_releases_in_order():
    buffer = ReorderBuffer()
    assert buffer.push(2, "c") == [] and buffer.push(1, "b") == []
    assert buffer.push(0, "a") == ["a", "b", "c"]
    assert buffer.push(3, "d") == ["d"] and len(buffer) == 0 and buffer.peak == 3
    with pytest.raises(ValueError):
        buffer.push(1, "again")


def test_parsing_lines_numbers_ids_and_errors():
    lines = ['{"prompt": "hi", "id": "a"}\n', "\n", '{"prompt": "yo"}', "nope", "[1]", '{"prompt": ""}',
             '{"text": "x", "id": 9}', '{"prompt": [{"role": "user", "content": "hey"}]}', b"\xff\xfe\n",
             '{"prompt": 3}']
    items = list(items_from_lines(lines, "jsonl"))
    assert [(i.line, i.id, i.error is None) for i in items] == [
        (1, "a", True), (3, 2, True), (4, None, False), (5, None, False), (6, 5, False), (7, 9, False),
        (8, 7, True), (9, None, False), (10, 9, False)]
    assert "invalid JSON" in items[2].error and "JSON object" in items[3].error
    assert items[4].error == "empty prompt" and items[5].error == "missing field 'prompt'"
    assert "UTF-8" in items[7].error and "string or a list" in items[8].error
    assert parse_json_line('{"text": "x"}', 1, field="text").prompt == "x"
    txt = list(items_from_lines(["first line\n", "  \n", "third\r\n"], "txt"))
    assert [(i.line, i.id, i.prompt) for i in txt] == [(1, 0, "first line"), (3, 2, "third")]
    assert (format_for("a.JSONL", ""), format_for("a.txt", "{"), format_for("-", '{"p": 1}'),
            format_for("x.dat", "hello")) == ("jsonl", "txt", "jsonl", "txt")
    with pytest.raises(BatchFileError):
        items_from_objects("a single prompt")


def test_torn_tail_is_cut_and_foreign_outputs_are_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 0, "line": 1, "output": "x"}\n{"id": 1, "line": 2, "err')
    assert cut_torn_tail(path) == len(b'{"id": 1, "line": 2, "err')
    state = prepare_output(path)
    assert (state.done, state.failed, state.last["line"]) == (1, 0, 1)
    path.write_bytes(b"no newline at all")
    assert prepare_output(path).done == 0 and path.read_bytes() == b""
    path.write_text('{"something": "else"}\n')
    with pytest.raises(BatchFileError, match="not a fastdecode batch record"):
        prepare_output(path)
    assert prepare_output(path, overwrite=True).done == 0


def test_resume_scan_reads_bounded_lines(tmp_path, monkeypatch):
    """An endless line (what /dev/zero would give) is refused after MAX_RECORD_BYTES, not read whole."""
    from fastdecode.pipeline import output

    monkeypatch.setattr(output, "MAX_RECORD_BYTES", 64)
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": 0, "line": 1}\n' + b"x" * 1000 + b"\n")
    with pytest.raises(BatchFileError, match="longer than 64 bytes"):
        prepare_output(path)


def test_skip_done_checks_the_output_belongs_to_the_input():
    items = lambda: items_from_lines(['{"prompt": "a", "id": "x"}', '{"prompt": "b", "id": "y"}', "{}"], "jsonl")
    assert [i.id for i in skip_done(items(), 2, {"id": "y", "line": 2})] == [2]
    with pytest.raises(BatchFileError, match="does not match"):
        list(skip_done(items(), 2, {"id": "other", "line": 2}))
    with pytest.raises(BatchFileError, match="only 3"):
        list(skip_done(items(), 5, {"id": 4, "line": 5}))


def test_settings_are_validated():
    with pytest.raises(InvalidOptionError, match="not both"):
        BatchSettings(batch_size=4, max_batch_tokens=100)
    with pytest.raises(InvalidOptionError, match="batch_size"):
        BatchSettings(batch_size=0)
    with pytest.raises(InvalidOptionError, match="max_new_tokens"):
        BatchRun(FakeEngine(), [], BatchSettings(), {"max_new_tokens": -1})


# -- the running pipeline ------------------------------------------------------------------------
def test_order_and_completeness_whatever_the_bucketing():
    rng = random.Random(1)
    prompts = ["x" * rng.randint(1, 50) + str(i) for i in range(300)]
    engine = FakeEngine()
    run = BatchRun(engine, make_items(prompts), BatchSettings(batch_size=7, lookahead=40), {"max_new_tokens": 4})
    records = list(run)
    assert [r["id"] for r in records] == list(range(300))
    assert [r["output"] for r in records] == [expected_output(p) for p in prompts]
    assert sorted(len(b) for b in engine.batches)[-1] == 7 and len(engine.batches) < 300 / 7 + 40 / 7 + 2
    assert engine.threads == {threading.current_thread().name}  # generation stays on the caller's thread
    assert run.stats.reorder_peak <= 40 and run.stats.written == 300


def test_num_return_sequences_gives_lists():
    run = BatchRun(FakeEngine(), make_items(["ab", "c"]), BatchSettings(batch_size=2),
                   {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 2})
    first, second = list(run)
    assert first["output"] == [expected_output("ab", r) for r in range(3)]
    assert first["num_tokens"] == [2, 2, 2] and first["finish_reason"] == ["length"] * 3


def test_memory_stays_flat_for_100k_inputs():
    """The reader never runs more than the queue bound ahead of the writer, whatever the input size."""
    n = 100_000
    lines = (f'{{"prompt": "p{i % 97}"}}\n' for i in range(n))  # lazy: the input never exists as a whole
    settings = BatchSettings(batch_size=64)
    written = 0

    def count(records):
        nonlocal written
        written += len(records)

    run = BatchRun(FakeEngine(), items_from_lines(lines, "jsonl"), settings, {"max_new_tokens": 1}, on_records=count)
    seen = sum(1 for _ in run)
    assert seen == written == n
    assert run.stats.max_ahead <= settings.max_items_in_flight() == 4 * 512
    assert run.stats.reorder_peak <= settings.window


def test_stages_overlap_total_time_is_about_the_slowest_stage():
    """read 10 ms/input, generate 50 ms/batch, detokenize 10 ms/input: 130 ms per batch of 4 in
    sequence, but pipelined the run takes about 12 x 50 ms plus filling and draining."""
    per_item_read, per_batch, per_item_decode, batches, size = 0.010, 0.050, 0.010, 12, 4

    def slow_lines():
        for i in range(batches * size):
            time.sleep(per_item_read)
            yield f"prompt {i}"

    engine = FakeEngine(batch_s=per_batch, decode_s=per_item_decode)
    run = BatchRun(engine, items_from_lines(slow_lines(), "txt"), BatchSettings(batch_size=size, lookahead=2 * size),
                   {"max_new_tokens": 2})
    started = time.perf_counter()
    assert len(list(run)) == batches * size
    elapsed = time.perf_counter() - started
    serial = batches * (size * per_item_read + per_batch + size * per_item_decode)  # 1.56 s
    slowest = batches * per_batch  # 0.6 s
    assert run.stats.read_s >= 0.9 * batches * size * per_item_read
    assert run.stats.post_s >= 0.9 * batches * size * per_item_decode
    assert slowest <= elapsed < 0.7 * serial, (elapsed, serial, run.stats)


def test_postprocess_overlaps_generation_even_when_bucketing_reorders_a_lot():
    """Expensive per-record work runs as records finish, not when they come out of the reorder
    buffer (which, with bucketing, releases them in bursts that would stall generation)."""
    rng = random.Random(3)
    prompts = ["x" * rng.randint(1, 80) for _ in range(64)]  # lengths all over: batches mix the order
    per_batch, per_record = 0.040, 0.008
    calls = []

    def postprocess(record):
        time.sleep(per_record)
        calls.append(record["id"])
        return {**record, "checked": True}

    run = BatchRun(FakeEngine(batch_s=per_batch), make_items(prompts), BatchSettings(batch_size=4, lookahead=16),
                   {}, postprocess=postprocess)
    started = time.perf_counter()
    records = list(run)
    elapsed = time.perf_counter() - started
    assert [r["id"] for r in records] == list(range(64)) and all(r["checked"] for r in records)
    assert calls != sorted(calls)  # completion order, not input order
    serial = 16 * (per_batch + 4 * per_record)  # 1.15 s
    assert elapsed < 0.75 * serial, (elapsed, serial, run.stats)


def test_a_prompt_that_fails_in_generation_fails_alone():
    prompts = ["short", "x" * 30, "fine", "also fine"]
    run = BatchRun(FakeEngine(max_prompt=20), make_items(prompts), BatchSettings(batch_size=4), {})
    records = list(run)
    assert [("error" in r) for r in records] == [False, True, False, False]
    assert records[1] == {"id": 1, "line": 2, "error": "prompt 0 has 30 tokens"}
    assert records[3]["output"] == expected_output("also fine")


def test_fail_fast_yields_what_came_before_then_raises():
    prompts = ["a", "b", "", "d"]
    run = BatchRun(FakeEngine(), make_items(prompts), BatchSettings(batch_size=2, fail_fast=True), {})
    seen = []
    with pytest.raises(BatchFileError, match="line 3: empty prompt"):
        for record in run:
            seen.append(record)
    assert [r["id"] for r in seen] == [0, 1]


def test_an_exception_in_a_background_stage_stops_the_run_and_reaches_the_caller():
    def broken_sink(records):
        raise OSError("disk full")

    run = BatchRun(FakeEngine(), make_items(["a"] * 50), BatchSettings(batch_size=4), {}, on_records=broken_sink)
    with pytest.raises(OSError, match="disk full"):
        list(run)

    def broken_input():
        yield "fine"
        raise RuntimeError("input went away")

    with pytest.raises(RuntimeError, match="went away"):
        list(BatchRun(FakeEngine(), make_items(broken_input()), BatchSettings(), {}))


def test_abandoning_the_iteration_stops_the_threads():
    before = threading.active_count()
    run = BatchRun(FakeEngine(), make_items(f"p{i}" for i in range(10_000)), BatchSettings(batch_size=4), {})
    iterator = iter(run)
    next(iterator)
    iterator.close()
    deadline = time.time() + 2
    while threading.active_count() > before and time.time() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before
    with pytest.raises(RuntimeError, match="only once"):
        list(run)
