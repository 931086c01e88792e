"""The asynchronous batch pipeline (FastSeq section 4.3): post-process while the engine generates.

Stages, threads and queues::

    reader thread    next input -> parse -> tokenize
          |  inputs queue, maxsize ``window`` (the reader reads and tokenizes ahead of generation)
    caller's thread  ONE long-lived engine: each input is submitted as it arrives while there is
          |          room, every step runs all of them together, finished ones leave at once
          |          (continuous batching, pipeline/feeding.py); no padding, no buckets
          |  post queue, maxsize POST_QUEUE steps' worth of finished inputs
    writer thread    detokenize -> records -> postprocess -> reorder buffer -> on_records (write + flush)
          |  out queue: records already delivered
    caller's thread  yields the records, in input order, between two steps

Torch kernels and tokenizers release the GIL, so the three threads genuinely overlap; waiting
(I/O, a GPU) overlaps completely. Every queue is bounded and an input enters generation only
within ``window`` inputs of the oldest one not yet written, so the reader never runs more than
``max_items_in_flight`` inputs ahead of the writer: memory is flat whatever the input size.
Generation stays in the caller's thread because a model (and a CUDA context) belongs there,
and because a Python generator can only yield from the thread that iterates it.

Per-record work that does not need input order (detokenizing, the ``postprocess`` hook: scoring,
filtering, uploading by id) runs in completion order, before the reorder buffer. Only
``on_records`` (appending to the output) waits for order: short outputs finish before long ones
started earlier, so records leave the reorder buffer in bursts, and an expensive in-order step
would stall the writer thread, fill the post queue and so stall generation.

Failure handling: a bad input becomes an error record; an input whose submission or generation
raises a ``FastDecodeError`` (e.g. its prompt is too long) fails alone. Any other exception in
any thread stops every stage and is re-raised in the caller's thread. With ``fail_fast`` the
first error record, in input order, stops the run: every record before it is written, it is not
(so a rerun after fixing the line resumes there).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import GenerationConfig
from ..errors import BatchFileError, FastDecodeError, InvalidOptionError
from .feeding import CallFeeder, EngineFeeder, Feeder, InFlight, Outcome, runs_in_engine
from .inputs import InputItem
from .records import ReorderBuffer, error_record, is_error, success_record
from .settings import POST_QUEUE, BatchSettings
from .stages import END, POLL_S, StageControl, Stopped

class Model(Protocol):
    """What the pipeline needs from a model: ``fastdecode.Generator`` (or a test double)."""

    def encode_prompt(self, prompt: Any, chat: bool = False) -> list[int]: ...

    def engine(self, **settings: Any) -> Any: ...  # a long-lived engine (pipeline/feeding.py)

    def generate_ids_with_details(self, prompts: Sequence[Sequence[int]], **options: Any) -> list[Any]: ...

    def decode_results(self, results: Sequence[Any], **options: Any) -> list[str]: ...


@dataclass
class PipelineStats:
    """Counters and busy times per stage; each field is written by one thread only."""

    read: int = 0  # inputs parsed and tokenized (reader)
    generated: int = 0  # inputs generated (caller's thread)
    written: int = 0  # records delivered in order (writer)
    failed: int = 0  # error records delivered
    new_tokens: int = 0  # generated tokens in delivered records
    steps: int = 0  # generation steps (engine steps, or generate calls for the strategies outside it)
    read_s: float = 0.0  # reading, parsing, tokenizing
    generate_s: float = 0.0  # submitting and stepping
    starve_s: float = 0.0  # caller's thread waiting for the reader with nothing to generate
    post_s: float = 0.0  # detokenizing, building records, on_records (writing)
    max_ahead: int = 0  # the most inputs the reader was ahead of the writer
    reorder_peak: int = 0  # the most records the reorder buffer held
    started: float = field(default_factory=time.perf_counter)

    @property
    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def count(self, records: Sequence[dict]) -> None:
        """Count records delivered in order (written, failed, new tokens)."""
        for record in records:
            self.failed += is_error(record)
            tokens = record.get("num_tokens", 0)
            self.new_tokens += sum(tokens) if isinstance(tokens, list) else tokens
        self.written += len(records)


def split_at_first_error(ready: list[dict], fail_fast: bool) -> tuple[list[dict], BatchFileError | None]:
    """With ``fail_fast``: the records before the first error record, and the error to raise
    once they are delivered; without it, every record and None."""
    stop_at = next((index for index, record in enumerate(ready) if is_error(record)), None) if fail_fast else None
    if stop_at is None:
        return ready, None
    bad = ready[stop_at]
    return ready[:stop_at], BatchFileError(f"line {bad['line']}: {bad['error']}")


class BatchRun:
    """One run of the pipeline over ``items``; iterate (once) for records in input order.

    Seeded sampling: input line n is sampled with seed ``derive_seed(seed, n)`` whatever runs
    beside it, so a resumed run or another batch size gives the same records.

    Both hooks run in the writer thread: ``postprocess(record) -> record`` once per record in
    completion order (put expensive per-record work here), ``on_records(records)`` with each
    group of records that just became ready, in input order (keep it cheap: the CLI appends and
    flushes there). ``stats`` can be read at any time, from any thread.
    """

    def __init__(self, model: Model, items: Iterable[InputItem], settings: BatchSettings,
                 options: dict[str, Any], on_records: Callable[[list[dict]], None] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        # Validate now, in the caller's thread, before any thread starts.
        self.config = GenerationConfig.from_options(getattr(model, "defaults", None), **options)
        if isinstance(self.config.seed, list):
            raise InvalidOptionError("a batch run takes one seed (each input's seed is derived from it and its line)")
        self.model = model
        self.items = items
        self.settings = settings
        self.options = dict(options)
        self.on_records = on_records
        self.postprocess = postprocess
        self.stats = PipelineStats()
        self._control = StageControl()
        self._inputs: queue.Queue = queue.Queue(maxsize=settings.window)
        self._post: queue.Queue = queue.Queue(maxsize=POST_QUEUE)
        self._out: queue.Queue = queue.Queue()
        self._delivered = threading.Event()  # set by the writer after each delivery
        self._reorder = ReorderBuffer()
        self._started = False

    # -- reader thread ----------------------------------------------------------------------
    def _tokenize(self, item: InputItem) -> None:
        if item.error is not None:
            return
        try:
            item.ids = self.model.encode_prompt(item.prompt, chat=self.settings.chat)
        except FastDecodeError as exc:
            item.error = str(exc)
            return
        if not item.ids:
            item.error = "the prompt encodes to no tokens"

    def _read_stage(self) -> None:
        stats, control = self.stats, self._control
        iterator = iter(self.items)
        while not control.stop.is_set():
            started = time.perf_counter()
            item = next(iterator, None)
            if item is None:
                break
            item.seq = stats.read
            self._tokenize(item)
            stats.read += 1
            stats.max_ahead = max(stats.max_ahead, stats.read - stats.written)
            stats.read_s += time.perf_counter() - started
            control.put(self._inputs, item)
        control.put(self._inputs, END)

    # -- writer thread ----------------------------------------------------------------------
    def _records(self, finished: list[tuple[InputItem, Outcome | None]]) -> list[tuple[int, dict]]:
        """Records of inputs that finished (an outcome of None: the input had failed before generation)."""
        good = [(item, results) for item, results in finished if isinstance(results, list)]
        flat = [result for _, results in good for result in results]
        texts = self.model.decode_results(flat, **self.options) if flat else []
        records, start = [], 0
        for item, results in good:
            r = len(results)
            records.append((item.seq, success_record(item, texts[start:start + r], [len(x.tokens) for x in results],
                                                     [x.finish_reason for x in results])))
            start += r
        for item, outcome in finished:
            if not isinstance(outcome, list):
                if outcome is not None:
                    item.error = str(outcome)
                records.append((item.seq, error_record(item)))
        if self.postprocess is not None:
            records = [(seq, self.postprocess(record)) for seq, record in records]
        return records

    def _deliver(self, ready: list[dict]) -> None:
        """Hand records that are in order to on_records and to the caller; fail fast if asked."""
        keep, first_error = split_at_first_error(ready, self.settings.fail_fast)
        if keep:
            if self.on_records is not None:
                self.on_records(keep)
            for record in keep:
                self._out.put(record)
            self.stats.count(keep)
            self._delivered.set()
        if first_error is not None:
            raise first_error

    def _post_stage(self) -> None:
        while True:
            work = self._control.get(self._post)
            if work is END:
                break
            started = time.perf_counter()
            ready = []
            for seq, record in self._records(work):
                ready += self._reorder.push(seq, record)
            self.stats.reorder_peak = max(self.stats.reorder_peak, self._reorder.peak)
            self._deliver(ready)
            self.stats.post_s += time.perf_counter() - started
        if len(self._reorder):
            raise RuntimeError(f"pipeline bug: {len(self._reorder)} records never became ready")
        self._out.put(END)

    # -- caller's thread --------------------------------------------------------------------
    def _drain(self) -> Iterator[dict]:
        while True:
            try:
                record = self._out.get_nowait()
            except queue.Empty:
                return
            if record is END:
                self._out.put(END)  # leave the end marker for the final wait
                return
            yield record

    def _feeder(self) -> Feeder:
        seeded = self.config.seed is not None and self.config.is_sampling
        if runs_in_engine(self.config):
            return EngineFeeder(self.model, self.settings.window, self.config.num_return_sequences,
                                self.config.max_new_tokens)
        return CallFeeder(self.model, seeded)

    def _item_options(self, item: InputItem) -> dict[str, Any]:
        """The run's options with the input's own ``response_format`` and seed."""
        from ..decoding.sampling import derive_seed  # torch: imported when the run starts

        options = self.options if item.response_format is None else {**self.options,
                                                                     "response_format": item.response_format}
        if self.config.seed is not None and self.config.is_sampling:
            options = {**options, "seed": derive_seed(self.config.seed, item.line)}
        return options

    def _next_input(self, wait: bool) -> Any:
        """The next tokenized input, END, or None when none is ready and ``wait`` is False."""
        if not wait:
            try:
                return self._inputs.get_nowait()
            except queue.Empty:
                return None
        waited = time.perf_counter()
        item = self._control.get(self._inputs)
        self.stats.starve_s += time.perf_counter() - waited
        return item

    def _generate_stage(self) -> Iterator[dict]:
        control, stats = self._control, self.stats
        feeder = self._feeder()
        room = InFlight(self.settings, self.config)
        held, reading = None, True  # held: an input read but not yet let in
        while reading or held is not None or feeder.has_work():
            if control.stop.is_set():  # another stage failed (or fail_fast stopped the run)
                raise Stopped
            finished: list[tuple[InputItem, Outcome | None]] = []
            started, starved = time.perf_counter(), stats.starve_s
            while reading or held is not None:
                if held is None:  # a call feeder fills up before it runs; the engine steps meanwhile
                    held = self._next_input(wait=(feeder.fills_up or not feeder.has_work()) and not finished)
                    if held is END:
                        held, reading = None, False
                if held is None:
                    break
                if not room.admits(held, stats.written):
                    if not feeder.has_work() and not finished:  # everything in the window waits for the writer
                        self._delivered.wait(POLL_S)
                        self._delivered.clear()
                    break
                item, held = held, None
                outcome = None if item.error is not None else feeder.submit(item, self._item_options(item))
                if item.error is not None or outcome is not None:
                    finished.append((item, outcome))
                else:
                    room.enter(item)
            if feeder.has_work():
                stats.steps += 1
                for item, outcome in feeder.step():
                    room.leave(item)
                    finished.append((item, outcome))
            stats.generate_s += time.perf_counter() - started - (stats.starve_s - starved)
            if finished:
                stats.generated += len(finished)
                control.put(self._post, finished)
            yield from self._drain()
        control.put(self._post, END)
        while (record := control.get(self._out)) is not END:
            yield record

    def __iter__(self) -> Iterator[dict]:
        if self._started:
            raise RuntimeError("a BatchRun can be iterated only once")
        self._started = True
        control = self._control
        threads = [control.run_stage(self._read_stage, "reader"), control.run_stage(self._post_stage, "writer")]
        finished = False
        try:
            yield from self._generate_stage()
            finished = True
        except Stopped:
            yield from self._drain()  # records written before the failure still reach the caller
            if control.error is not None:
                raise control.error from None
        finally:
            if not finished:
                control.stop.set()
            for thread in threads:
                thread.join(timeout=None if finished else 2 * POLL_S + 1)

    def __enter__(self) -> "BatchRun":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._control.stop.set()
