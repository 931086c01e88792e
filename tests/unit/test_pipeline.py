"""The batch pipeline with a fake engine: continuous feeding, order, bounded memory, overlap, failures, resume files."""

from __future__ import annotations

import json
import random
import threading
import time
from types import SimpleNamespace

import pytest

from fastdecode.errors import BatchFileError, InvalidOptionError, PromptTooLongError
from fastdecode.engine.sequence import SequenceResult
from fastdecode.pipeline import BatchRun, BatchSettings, InputItem, items_from_lines, items_from_objects
from fastdecode.pipeline.inputs import format_for, parse_json_line, skip_done
from fastdecode.pipeline.output import cut_torn_tail, prepare_output
from fastdecode.pipeline.records import ReorderBuffer


class FakeSequence:
    def __init__(self, seq_id: int, prompt: list[int], choice: int, steps: int):
        self.id, self.output_ids, self.steps_left = seq_id, [sum(prompt) % 1000, choice], steps
        self.stop_kind = None
        self.inputs = tuple(prompt)

    @property
    def finished(self) -> bool:
        return self.stop_kind is not None


class FakeContinuousEngine:
    """Stands in for the engine: a sequence finishes after ``steps(prompt)`` steps of ``step_s`` each."""

    def __init__(self, owner: "FakeEngine", max_queue: int):
        self.owner, self.max_queue = owner, max_queue
        self.running: list[FakeSequence] = []
        self.next_id = 0

    def submit_choices(self, prompt, options):
        owner = self.owner
        owner.threads.add(threading.current_thread().name)
        if owner.max_prompt is not None and len(prompt) > owner.max_prompt:
            raise PromptTooLongError(f"prompt 0 has {len(prompt)} tokens")
        owner.options.append(options)
        sequences = []
        for choice in range(options.get("num_return_sequences", 1)):
            sequences.append(FakeSequence(self.next_id, prompt, choice, owner.steps(prompt)))
            self.next_id += 1
        assert len(self.running) + len(sequences) <= self.max_queue
        self.running += sequences
        return sequences

    def step(self):
        owner = self.owner
        owner.threads.add(threading.current_thread().name)
        owner.peak_inputs = max(owner.peak_inputs, len({(s.inputs, s.id - s.output_ids[1]) for s in self.running}))
        owner.steps_run += 1
        time.sleep(owner.step_s)
        events = []
        for sequence in self.running:
            sequence.steps_left -= 1
            if sequence.steps_left == 0:
                sequence.stop_kind = "length"
            events.append(SimpleNamespace(sequence=sequence, finished=sequence.finished))
        self.running = [s for s in self.running if not s.finished]
        return events

    def has_work(self):
        return bool(self.running)


class FakeEngine:
    """Stands in for Generator: one token per prompt character; output is a pure function of the prompt.

    ``step_s`` / ``decode_s`` sleep per engine step / per result (sleep releases the GIL as real
    kernels and I/O do), to give each stage a known cost; an input takes ``steps(prompt)`` steps
    (by default 1 to 3, by length, so that inputs finish out of order).
    """

    def __init__(self, step_s: float = 0.0, decode_s: float = 0.0, max_prompt: int | None = None, steps=None):
        self.step_s, self.decode_s, self.max_prompt = step_s, decode_s, max_prompt
        self.steps = steps or (lambda prompt: 1 + len(prompt) % 3)
        self.engines: list[FakeContinuousEngine] = []
        self.calls: list[list[list[int]]] = []  # generate_ids_with_details calls (beam search...)
        self.options: list[dict] = []
        self.threads: set[str] = set()
        self.peak_inputs = self.steps_run = 0
        self.config = SimpleNamespace(max_position_embeddings=256, kv_cache_bytes_per_token=lambda itemsize: 1 << 20)
        self.model = SimpleNamespace(dtype=SimpleNamespace(itemsize=4))

    def encode_prompt(self, prompt, chat=False):
        return [ord(c) for c in prompt]

    def engine(self, max_queue, cache_tokens):
        assert cache_tokens >= self.config.max_position_embeddings
        self.engines.append(FakeContinuousEngine(self, max_queue))
        return self.engines[-1]

    def generate_ids_with_details(self, prompts, num_return_sequences=1, **options):
        self.threads.add(threading.current_thread().name)
        for index, prompt in enumerate(prompts):
            if self.max_prompt is not None and len(prompt) > self.max_prompt:
                raise PromptTooLongError(f"prompt {index} has {len(prompt)} tokens")
        self.calls.append([list(p) for p in prompts])
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


def test_in_flight_bounds_inputs_tokens_and_the_reorder_window():
    from fastdecode.config import GenerationConfig
    from fastdecode.pipeline.feeding import InFlight

    items = tokenized([3, 4, 5, 40, 2])
    by_rows = InFlight(BatchSettings(batch_size=2, lookahead=3), GenerationConfig(max_new_tokens=2))
    assert by_rows.admits(items[0], written=0)
    by_rows.enter(items[0]), by_rows.enter(items[1])
    assert not by_rows.admits(items[2], written=0)  # two inputs generating: batch_size
    by_rows.leave(items[0])
    assert by_rows.admits(items[2], written=0) and not by_rows.admits(items[3], written=0)  # lookahead 3
    assert by_rows.admits(items[3], written=1)
    # budget: rows x (prompt + new tokens), unpadded: 2*(3+2) + 2*(4+2) = 22 fits 30, + 2*(5+2) does not
    by_tokens = InFlight(BatchSettings(max_batch_tokens=30), GenerationConfig(max_new_tokens=2, num_return_sequences=2))
    by_tokens.enter(items[0])
    assert by_tokens.admits(items[1], 0)
    by_tokens.enter(items[1])
    assert not by_tokens.admits(items[2], 0)
    alone = InFlight(BatchSettings(max_batch_tokens=30), GenerationConfig(max_new_tokens=2))
    assert alone.admits(items[3], 0)  # over the budget on its own: runs, alone
    alone.enter(items[3])
    assert not alone.admits(items[4], 0)


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


def test_a_line_with_its_own_generation_options_is_an_error_not_silently_run_without_them():
    """A line's max_new_tokens / temperature / ... were dropped (the run's options applied); only its
    response_format is read. Fields that are no option names (a dataset's metadata) stay allowed."""
    lines = ['{"prompt": "a", "max_new_tokens": 5}', '{"prompt": "b", "temperature": 0.2, "max_tokens": 9}',
             '{"prompt": "c", "category": "geo", "response_format": {"type": "json_object"}}']
    items = list(items_from_lines(lines, "jsonl"))
    assert "not max_new_tokens" in items[0].error and "not max_tokens, temperature" in items[1].error
    assert items[2].error is None and items[2].response_format == {"type": "json_object"}
    assert "not seed" in next(iter(items_from_objects([{"prompt": "d", "seed": 3}]))).error


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
def test_order_and_completeness_with_one_long_lived_engine():
    rng = random.Random(1)
    prompts = ["x" * rng.randint(1, 50) + str(i) for i in range(300)]
    engine = FakeEngine(step_s=0.003)  # a step takes time (releasing the GIL), as a real one: the reader keeps up
    run = BatchRun(engine, make_items(prompts), BatchSettings(batch_size=7, lookahead=40), {"max_new_tokens": 4})
    records = list(run)
    assert [r["id"] for r in records] == list(range(300))
    assert [r["output"] for r in records] == [expected_output(p) for p in prompts]
    assert len(engine.engines) == 1 and not engine.calls  # one engine for the whole run, no batch calls
    assert engine.peak_inputs == 7  # refilled as inputs finish, never more than batch_size
    assert engine.steps_run < 300 * 2 / 7 + 10  # about (steps per input) x inputs / batch_size
    assert engine.threads == {threading.current_thread().name}  # generation stays on the caller's thread
    assert run.stats.reorder_peak <= 40 and run.stats.written == 300


def test_num_return_sequences_gives_lists_and_lines_get_their_own_seed_and_format():
    from fastdecode.decoding.sampling import derive_seed

    objects = [{"prompt": "ab"}, {"prompt": "c", "response_format": {"type": "json_object"}}]
    engine = FakeEngine()
    run = BatchRun(engine, make_items(objects), BatchSettings(batch_size=2),
                   {"do_sample": True, "num_return_sequences": 3, "max_new_tokens": 2, "seed": 5})
    first, second = list(run)
    assert first["output"] == [expected_output("ab", r) for r in range(3)]
    assert first["num_tokens"] == [2, 2, 2] and first["finish_reason"] == ["length"] * 3
    assert [o["seed"] for o in engine.options] == [derive_seed(5, 1), derive_seed(5, 2)]
    assert [o.get("response_format") for o in engine.options] == [None, {"type": "json_object"}]


def test_strategies_outside_the_engine_go_through_generate_calls():
    prompts = [f"p{i}" * (i % 4 + 1) for i in range(10)]
    engine = FakeEngine()
    records = list(BatchRun(engine, make_items(prompts), BatchSettings(batch_size=4), {"num_beams": 2}))
    assert [r["output"] for r in records] == [expected_output(p) for p in prompts]
    assert not engine.engines and [len(call) for call in engine.calls] == [4, 4, 2]  # filled up first


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
    assert run.stats.max_ahead <= settings.max_items_in_flight() == 2 * 512 + 2
    assert run.stats.reorder_peak <= settings.window


def test_a_long_input_does_not_let_the_reorder_buffer_grow():
    """Short inputs keep finishing behind a long one: they start only within lookahead of it."""
    prompts = ["long"] + ["s"] * 200
    engine = FakeEngine(steps=lambda prompt: 150 if len(prompt) == 4 else 1)
    run = BatchRun(engine, make_items(prompts), BatchSettings(batch_size=4, lookahead=20), {})
    assert [r["output"] for r in run] == [expected_output(p) for p in prompts]
    assert run.stats.reorder_peak <= 20 and run.stats.max_ahead <= BatchSettings(lookahead=20).max_items_in_flight()


def test_stages_overlap_total_time_is_about_the_slowest_stage():
    """read 10 ms/input, generate 2 steps of 25 ms per input (4 at once), detokenize 10 ms/input:
    130 ms per 4 inputs in sequence, but pipelined the run takes about 24 x 25 ms plus filling
    and draining."""
    per_item_read, per_step, per_item_decode, groups, size = 0.010, 0.025, 0.010, 12, 4

    def slow_lines():
        for i in range(groups * size):
            time.sleep(per_item_read)
            yield f"prompt {i}"

    engine = FakeEngine(step_s=per_step, decode_s=per_item_decode, steps=lambda prompt: 2)
    run = BatchRun(engine, items_from_lines(slow_lines(), "txt"), BatchSettings(batch_size=size, lookahead=2 * size),
                   {"max_new_tokens": 2})
    started = time.perf_counter()
    assert len(list(run)) == groups * size
    elapsed = time.perf_counter() - started
    serial = groups * (size * per_item_read + 2 * per_step + size * per_item_decode)  # 1.56 s
    slowest = groups * 2 * per_step  # 0.6 s
    assert run.stats.read_s >= 0.9 * groups * size * per_item_read
    assert run.stats.post_s >= 0.9 * groups * size * per_item_decode
    assert slowest <= elapsed < 0.7 * serial, (elapsed, serial, run.stats)


def test_postprocess_overlaps_generation_in_completion_order():
    """Expensive per-record work runs as records finish, not when they come out of the reorder
    buffer (which releases them in bursts when short inputs finish behind long ones)."""
    rng = random.Random(3)
    prompts = ["x" * rng.randint(1, 80) for _ in range(64)]  # 1 to 3 steps each: they finish out of order
    per_step, per_record = 0.020, 0.008
    calls = []

    def postprocess(record):
        time.sleep(per_record)
        calls.append(record["id"])
        return {**record, "checked": True}

    engine = FakeEngine(step_s=per_step)
    run = BatchRun(engine, make_items(prompts), BatchSettings(batch_size=4, lookahead=16), {}, postprocess=postprocess)
    started = time.perf_counter()
    records = list(run)
    elapsed = time.perf_counter() - started
    assert [r["id"] for r in records] == list(range(64)) and all(r["checked"] for r in records)
    assert calls != sorted(calls)  # completion order, not input order
    serial = run.stats.generate_s + run.stats.post_s  # as measured (sleeps overshoot on a busy machine)
    assert serial >= engine.steps_run * per_step + 64 * per_record
    assert elapsed < 0.8 * serial, (elapsed, serial, run.stats)


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
