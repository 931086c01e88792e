"""The body of `fastdecode batch INPUT -o OUTPUT` (the command and its flags: cli/batch.py; the
pipeline itself: pipeline/): the pipeline over a file, resumable, with a progress bar.

Exit codes: 0 every input succeeded; 1 some inputs failed (error records in the output,
counting those an earlier, resumed run wrote); 2 bad usage, an output that does not belong to
the input, an output another run is writing, or the first failed input with --fail-fast; 3 the
output could not be written (disk full, I/O error): what was written is intact, rerun to resume.

The input is read once, as it streams (a pipe or a FIFO works): the progress bar's total is
counted beforehand only for a regular file.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import stat
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import BatchFileError, ModelNotFoundError
from ..load_settings import LoadSettings
from ..pipeline.inputs import BOM, InputItem, format_for, items_from_lines, skip_done, text_lines
from ..pipeline.output import OutputFile, OutputState, encode_record, same_file
from ..pipeline.runner import BatchRun, PipelineStats, split_at_first_error
from ..pipeline.settings import BatchSettings, resolve_chat

if TYPE_CHECKING:  # pragma: no cover
    from ..integrations.ray_batch import RayOptions

POSTFIX_EVERY_S = 0.5  # progress-bar text refresh period (tqdm throttles the bar itself)


def read_input(path: str, input_format: str, field: str) -> Iterator[InputItem]:
    """Items of a file or stdin ("-"), read lazily (in the pipeline's reader thread).

    Lines are read as bytes (a bad UTF-8 line is one failed input); with ``input_format``
    "auto" the format comes from the suffix, else from the first non-blank line.
    """
    handle = sys.stdin.buffer if path == "-" else open(path, "rb")
    try:
        lines = text_lines(handle)
        head: list[str | bytes] = []
        fmt = input_format
        if fmt == "auto":
            for raw in lines:
                head.append(raw)
                if raw.strip():
                    break
            first = head[-1] if head else ""
            first = (first.decode("utf-8", errors="replace") if isinstance(first, bytes) else first).lstrip(BOM)
            fmt = format_for("" if path == "-" else path, first)
        yield from items_from_lines(itertools.chain(head, lines), fmt, field)
    finally:
        if handle is not sys.stdin.buffer:
            handle.close()


def count_inputs(path: str) -> int | None:
    """Non-blank lines of the input (the progress total) when it is a regular file; None for stdin,
    a pipe or a FIFO, which can be read only once (counting would consume them)."""
    if path == "-" or not stat.S_ISREG(os.stat(path).st_mode):
        return None
    with open(path, "rb") as handle:
        return sum(1 for raw in text_lines(handle) if raw.strip())


def check_not_input(input_path: str, output: str) -> None:
    """The output must not be the input under another name (a hard link, a symlink, stdin)."""
    try:
        out = os.stat(output)
        source = os.fstat(0) if input_path == "-" else os.stat(input_path)
    except (OSError, ValueError):
        return  # no output yet, or no stdin: nothing to clobber
    if same_file(source, out):
        raise BatchFileError(f"the output {output} is the input file (same device and inode)")


class StdoutRecords:
    """``-o -``: records to stdout, nothing to resume or lock."""

    state = OutputState()

    def __call__(self, records: list[dict]) -> None:
        sys.stdout.buffer.write(b"".join(encode_record(record) for record in records))
        sys.stdout.buffer.flush()

    def close(self) -> None:
        pass


class Progress:
    """tqdm on stderr: samples done / total, samples/s, ETA, plus new tokens/s as postfix."""

    def __init__(self, total: int | None, done: int, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="sample", file=sys.stderr, disable=quiet,
                        dynamic_ncols=True, smoothing=0.1)
        self.started = time.perf_counter()
        self.shown = 0.0

    def update(self, new_tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self.shown >= POSTFIX_EVERY_S:
            self.shown = now
            self.bar.set_postfix_str(f"{new_tokens / max(now - self.started, 1e-9):.1f} tok/s", refresh=False)

    def close(self, new_tokens: int) -> None:
        self.update(new_tokens, force=True)
        self.bar.close()


def run_batch(input_path: str, output: str, load: LoadSettings, options: dict[str, Any], settings: BatchSettings,
              field: str, input_format: str, chat: bool | None, quiet: bool, overwrite: bool,
              ray: "RayOptions | None" = None) -> int:
    """The body of `fastdecode batch`; returns the exit code (0 all ok, 1 some inputs failed).

    The output is opened (and locked) before the model loads, so a second run on the same
    output fails at once, and held until the run ends. ``ray``: generate on Ray actors
    (integrations/ray_batch.py) instead of in this process; the input, the output file, resuming
    and the records are the same.
    """
    from ..config import GenerationConfig

    GenerationConfig.from_options(**options)  # reject bad options before loading anything
    for path, stream, what in ((input_path, sys.stdin, "input"), (output, sys.stdout, "output")):
        if path == "-" and stream is None:
            raise BatchFileError(f"standard {what} is closed ('-' names it)")
    if output != "-":
        check_not_input(input_path, output)
    writer = StdoutRecords() if output == "-" else OutputFile(output, overwrite=overwrite)
    try:
        return _run_to(writer, input_path, output, load, options, settings, field, input_format, chat, quiet, ray)
    finally:
        writer.close()


def _run_to(writer: OutputFile | StdoutRecords, input_path: str, output: str, load: LoadSettings,
            options: dict[str, Any], settings: BatchSettings, field: str, input_format: str, chat: bool | None,
            quiet: bool, ray: "RayOptions | None") -> int:
    state = writer.state
    if state.truncated_bytes and not quiet:
        click.echo(f"resume: cut a torn last line ({state.truncated_bytes} bytes) from {output}", err=True)
    if state.done and not quiet:
        click.echo(f"resume: {state.done} inputs already in {output}, skipping them", err=True)
    items = skip_done(read_input(input_path, input_format, field), state.done, state.last)
    total = count_inputs(input_path)
    progress = Progress(total, state.done, quiet)
    if ray is None:
        stats = _run_here(items, load, options, settings, chat, writer, progress)
    else:
        remaining = None if total is None else max(total - state.done, 0)
        stats = _run_on_ray(items, remaining, load, options, settings, field, chat, writer, progress, ray)
    failed = state.failed + stats.failed
    if not quiet:
        elapsed = stats.elapsed_s
        click.echo(
            f"{stats.written} inputs in {elapsed:.1f}s ({stats.written / max(elapsed, 1e-9):.2f} samples/s, "
            f"{stats.new_tokens / max(elapsed, 1e-9):.1f} new tokens/s), {stats.failed} failed"
            f"{f' (+{state.failed} in the earlier run)' if state.failed else ''} -> {output}",
            err=True,
        )
    return 1 if failed else 0


def _run_here(items: Iterator[InputItem], load: LoadSettings, options: dict[str, Any], settings: BatchSettings,
              chat: bool | None, writer: Callable[[list[dict]], None], progress: Progress) -> PipelineStats:
    """Generate in this process through the asynchronous pipeline (its writer thread appends)."""
    generator = load.load()
    settings = dataclasses.replace(settings, chat=resolve_chat(generator, chat))
    run = BatchRun(generator, items, settings, options, on_records=writer)
    try:
        for _ in run:
            progress.bar.update(1)
            progress.update(run.stats.new_tokens)
    finally:
        progress.close(run.stats.new_tokens)
    return run.stats


def _run_on_ray(items: Iterator[InputItem], remaining: int | None, load: LoadSettings, options: dict[str, Any],
                settings: BatchSettings, field: str, chat: bool | None, writer: Callable[[list[dict]], None],
                progress: Progress, ray: "RayOptions") -> PipelineStats:
    """Generate on Ray actors; append each group of records that arrived in input order."""
    from ..integrations.ray_batch import quiet_ray_logs, ray_connection, ray_records

    stats = PipelineStats()
    predictor = dict(**dataclasses.asdict(load), options=options, field=field, chat=chat,
                     batch_size=settings.batch_size, max_batch_tokens=settings.max_batch_tokens)
    if ray.address == "local" and load.model is not None and not Path(load.model).exists():
        # before Ray starts actors that cannot load it
        raise ModelNotFoundError(f"model path {load.model} does not exist")
    quiet_ray_logs()
    try:
        with ray_connection(ray):
            for ready in ray_records(items, predictor, ray, settings.window, remaining):
                keep, first_error = split_at_first_error(ready, settings.fail_fast)
                if keep:
                    writer(keep)
                    stats.count(keep)
                    progress.bar.update(len(keep))
                    progress.update(stats.new_tokens)
                if first_error is not None:
                    raise first_error
    finally:
        progress.close(stats.new_tokens)
    return stats
