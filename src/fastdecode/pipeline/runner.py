"""The asynchronous batch pipeline (FastSeq section 4.3): post-process one batch while the next generates.

Stages, threads and queues::

    reader thread    next input -> parse -> tokenize -> window of `lookahead` items -> batches
          |  windows queue, maxsize 1 (one planned window waits while the reader fills the next)
    caller's thread  generate each batch: the device work, on the thread that owns the model
          |  post queue, maxsize POST_QUEUE batches
    writer thread    detokenize -> records -> postprocess -> reorder buffer -> on_records (write + flush)
          |  out queue: records already delivered, fed only by batches the caller generated
    caller's thread  yields the records, in input order, between two batches

Torch kernels and tokenizers release the GIL, so the three threads genuinely overlap; waiting
(I/O, a GPU) overlaps completely. Every queue is bounded, so the reader never runs more than
``max_items_in_flight`` inputs ahead of the writer: memory is flat whatever the input size.
Generation stays in the caller's thread because a model (and a CUDA context) belongs there,
and because a Python generator can only yield from the thread that iterates it.

Per-record work that does not need input order (detokenizing, the ``postprocess`` hook: scoring,
filtering, uploading by id) runs in completion order, before the reorder buffer. Only
``on_records`` (appending to the output) waits for order: with length bucketing, records leave
the reorder buffer in bursts, and an expensive in-order step would stall the writer thread,
fill the post queue and so stall generation.

Failure handling: a bad input becomes an error record; a batch whose generation raises a
``FastDecodeError`` (e.g. one prompt too long) is retried one prompt at a time so that only the
bad prompt fails. Any other exception in any thread stops every stage and is re-raised in the
caller's thread. With ``fail_fast`` the first error record, in input order, stops the run:
every record before it is written, it is not (so a rerun after fixing the line resumes there).
"""

from __future__ import annotations

import json

import queue
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import GenerationConfig
from ..errors import BatchFileError, FastDecodeError, InvalidOptionError
from .batching import plan_window
from .inputs import InputItem
from .records import ReorderBuffer, error_record, is_error, success_record
from .settings import POST_QUEUE, BatchSettings
from .stages import END, POLL_S, StageControl, Stopped

class Engine(Protocol):
    """What the pipeline needs from a model: ``fastdecode.Generator`` (or a test double)."""

    def encode_prompt(self, prompt: Any, chat: bool = False) -> list[int]: ...

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
    batches: int = 0
    read_s: float = 0.0  # reading, parsing, tokenizing
    generate_s: float = 0.0  # generate_ids_with_details
    starve_s: float = 0.0  # caller's thread waiting for the reader
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


@dataclass
class _Batch:
    items: list[InputItem]  # tokenized inputs to generate together
    failed: list[InputItem]  # inputs that already failed (ride along so that order is kept)


def generate_batch(engine: Engine, prompts: list[list[int]], options: dict[str, Any],
                   rows_per_prompt: int, seeds: list[int] | None = None) -> list[list[Any] | FastDecodeError]:
    """Per prompt: its ``rows_per_prompt`` results, or the FastDecodeError it alone causes.

    The batch is tried whole first; only if it raises a FastDecodeError (a prompt too long...)
    is every prompt retried alone, so one bad prompt costs its batch-mates nothing but a retry.
    ``seeds``: one sampling seed per prompt (see ``BatchRun``), or None.
    """
    try:
        flat = engine.generate_ids_with_details(prompts, **(options if seeds is None else {**options, "seed": seeds}))
    except FastDecodeError as exc:
        if len(prompts) == 1:
            return [exc]
        return [generate_batch(engine, [prompt], options, rows_per_prompt, None if seeds is None else [seeds[i]])[0]
                for i, prompt in enumerate(prompts)]
    r = rows_per_prompt
    return [flat[index * r:(index + 1) * r] for index in range(len(prompts))]


class BatchRun:
    """One run of the pipeline over ``items``; iterate (once) for records in input order.

    Seeded sampling: input line n is sampled with seed ``derive_seed(seed, n)`` whatever batch it
    lands in, so a resumed run or another batch size gives the same records.

    Both hooks run in the writer thread: ``postprocess(record) -> record`` once per record in
    completion order (put expensive per-record work here), ``on_records(records)`` with each
    group of records that just became ready, in input order (keep it cheap: the CLI appends and
    flushes there). ``stats`` can be read at any time, from any thread.
    """

    def __init__(self, engine: Engine, items: Iterable[InputItem], settings: BatchSettings,
                 options: dict[str, Any], on_records: Callable[[list[dict]], None] | None = None,
                 postprocess: Callable[[dict], dict] | None = None):
        # Validate now, in the caller's thread, before any thread starts.
        self.config = GenerationConfig.from_options(getattr(engine, "defaults", None), **options)
        if isinstance(self.config.seed, list):
            raise InvalidOptionError("a batch run takes one seed (each input's seed is derived from it and its line)")
        self.engine = engine
        self.items = items
        self.settings = settings
        self.options = dict(options)
        self.on_records = on_records
        self.postprocess = postprocess
        self.stats = PipelineStats()
        self._control = StageControl()
        self._windows: queue.Queue = queue.Queue(maxsize=1)
        self._post: queue.Queue = queue.Queue(maxsize=POST_QUEUE)
        self._out: queue.Queue = queue.Queue()
        self._reorder = ReorderBuffer()
        self._started = False

    # -- reader thread ----------------------------------------------------------------------
    def _tokenize(self, item: InputItem) -> None:
        if item.error is not None:
            return
        try:
            item.ids = self.engine.encode_prompt(item.prompt, chat=self.settings.chat)
        except FastDecodeError as exc:
            item.error = str(exc)
            return
        if not item.ids:
            item.error = "the prompt encodes to no tokens"

    def _plan(self, window: list[InputItem]) -> list[_Batch]:
        good = [item for item in window if item.error is None]
        failed = [item for item in window if item.error is not None]
        batches = [
            _Batch(batch, [])
            for batch in plan_window(good, self.settings.rows, self.settings.max_batch_tokens,
                                     self.config.num_return_sequences, self.config.max_new_tokens)
        ]
        if not batches:
            return [_Batch([], failed)]
        batches[0].failed = failed
        return batches

    def _read_stage(self) -> None:
        stats, control, window = self.stats, self._control, []
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
            window.append(item)
            if len(window) >= self.settings.window:
                batches = self._plan(window)
                stats.read_s += time.perf_counter() - started
                control.put(self._windows, batches)
                window = []
            else:
                stats.read_s += time.perf_counter() - started
        if window:
            control.put(self._windows, self._plan(window))
        control.put(self._windows, END)

    # -- writer thread ----------------------------------------------------------------------
    def _records(self, batch: _Batch, outcomes: list[list[Any] | FastDecodeError]) -> list[tuple[int, dict]]:
        good = [(item, results) for item, results in zip(batch.items, outcomes) if not isinstance(results, Exception)]
        flat = [result for _, results in good for result in results]
        texts = self.engine.decode_results(flat, **self.options) if flat else []
        records, start = [], 0
        for item, results in good:
            r = len(results)
            records.append((item.seq, success_record(item, texts[start:start + r], [len(x.tokens) for x in results],
                                                     [x.finish_reason for x in results])))
            start += r
        for item, outcome in zip(batch.items, outcomes):
            if isinstance(outcome, Exception):
                item.error = str(outcome)
                records.append((item.seq, error_record(item)))
        records += [(item.seq, error_record(item)) for item in batch.failed]
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
        if first_error is not None:
            raise first_error

    def _post_stage(self) -> None:
        while True:
            work = self._control.get(self._post)
            if work is END:
                break
            started = time.perf_counter()
            ready = []
            for seq, record in self._records(*work):
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

    def _generate_stage(self) -> Iterator[dict]:
        from ..generation.sampling import derive_seed  # torch: imported when the run starts

        control, stats = self._control, self.stats
        r = self.config.num_return_sequences
        while True:
            waited = time.perf_counter()
            window = control.get(self._windows)
            stats.starve_s += time.perf_counter() - waited
            if window is END:
                break
            for batch in window:
                started = time.perf_counter()
                seeds = None if self.config.seed is None or not self.config.is_sampling else \
                    [derive_seed(self.config.seed, item.line) for item in batch.items]
                outcomes = self._generate(batch.items, seeds) if batch.items else []
                stats.generate_s += time.perf_counter() - started
                stats.generated += len(batch.items)
                stats.batches += bool(batch.items)
                control.put(self._post, (batch, outcomes))
                yield from self._drain()
        control.put(self._post, END)
        while (record := control.get(self._out)) is not END:
            yield record

    def _generate(self, items: list[InputItem], seeds: list[int] | None) -> list[list[Any] | FastDecodeError]:
        """generate_batch per group of inputs that share a ``response_format`` (their own, or none),
        outcomes back in the items' order."""
        groups: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            groups.setdefault(json.dumps(item.response_format, sort_keys=True, default=repr), []).append(index)
        outcomes: list[Any] = [None] * len(items)
        for indexes in groups.values():
            constraint = items[indexes[0]].response_format
            options = self.options if constraint is None else {**self.options, "response_format": constraint}
            got = generate_batch(self.engine, [items[i].ids for i in indexes], options,
                                 self.config.num_return_sequences, seeds and [seeds[i] for i in indexes])
            for index, outcome in zip(indexes, got):
                outcomes[index] = outcome
        return outcomes

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
