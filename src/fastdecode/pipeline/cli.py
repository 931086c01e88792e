"""`fastdecode batch INPUT -o OUTPUT`: the pipeline over a file, resumable, with a progress bar.

The command is built by ``batch_command(...)`` from the shared option decorators of
``fastdecode.cli`` (passed in rather than imported: ``fastdecode.cli`` registers this command,
so importing it back from here would be an import cycle, fatal under ``python -m fastdecode.cli``).

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
from .inputs import BOM, InputItem, format_for, items_from_lines, skip_done
from .output import OutputFile, OutputState, encode_record, same_file
from .runner import BatchRun, BatchSettings, PipelineStats, split_at_first_error

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
        head: list[bytes] = []
        fmt = input_format
        if fmt == "auto":
            for raw in handle:
                head.append(raw)
                if raw.strip():
                    break
            first = head[-1].decode("utf-8", errors="replace").lstrip(BOM) if head else ""
            fmt = format_for("" if path == "-" else path, first)
        yield from items_from_lines(itertools.chain(head, handle), fmt, field)
    finally:
        if handle is not sys.stdin.buffer:
            handle.close()


def count_inputs(path: str) -> int | None:
    """Non-blank lines of the input (the progress total) when it is a regular file; None for stdin,
    a pipe or a FIFO, which can be read only once (counting would consume them)."""
    if path == "-" or not stat.S_ISREG(os.stat(path).st_mode):
        return None
    with open(path, "rb") as handle:
        return sum(1 for raw in handle if raw.strip())


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


def resolve_chat(generator: Any, chat: bool | None) -> bool:
    """--chat / --no-chat, or by default: on when the model's tokenizer has a chat template."""
    if chat is not None:
        return chat
    return bool(generator.tokenizer is not None and generator.tokenizer.chat_template)


def run_batch(input_path: str, output: str, model: str | None, device: str, dtype: str, options: dict[str, Any],
              settings: BatchSettings, field: str, input_format: str, chat: bool | None, quiet: bool,
              overwrite: bool, ray: "RayOptions | None" = None, quantize: str | None = None) -> int:
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
        return _run_to(writer, input_path, output, model, device, dtype, options, settings, field, input_format,
                       chat, quiet, ray, quantize)
    finally:
        writer.close()


def _run_to(writer: OutputFile | StdoutRecords, input_path: str, output: str, model: str | None, device: str,
            dtype: str, options: dict[str, Any], settings: BatchSettings, field: str, input_format: str,
            chat: bool | None, quiet: bool, ray: "RayOptions | None", quantize: str | None) -> int:
    state = writer.state
    if state.truncated_bytes and not quiet:
        click.echo(f"resume: cut a torn last line ({state.truncated_bytes} bytes) from {output}", err=True)
    if state.done and not quiet:
        click.echo(f"resume: {state.done} inputs already in {output}, skipping them", err=True)
    items = skip_done(read_input(input_path, input_format, field), state.done, state.last)
    total = count_inputs(input_path)
    progress = Progress(total, state.done, quiet)
    if ray is None:
        stats = _run_here(items, model, device, dtype, quantize, options, settings, chat, writer, progress)
    else:
        remaining = None if total is None else max(total - state.done, 0)
        stats = _run_on_ray(items, remaining, model, device, dtype, quantize, options, settings, field, chat,
                            writer, progress, ray)
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


def _run_here(items: Iterator[InputItem], model: str | None, device: str, dtype: str, quantize: str | None,
              options: dict[str, Any],
              settings: BatchSettings, chat: bool | None, writer: Callable[[list[dict]], None],
              progress: Progress) -> PipelineStats:
    """Generate in this process through the asynchronous pipeline (its writer thread appends)."""
    from .. import load

    generator = load(model, device=device, dtype=dtype, quantize=quantize)
    settings = dataclasses.replace(settings, chat=resolve_chat(generator, chat))
    run = BatchRun(generator, items, settings, options, on_records=writer)
    try:
        for _ in run:
            progress.bar.update(1)
            progress.update(run.stats.new_tokens)
    finally:
        progress.close(run.stats.new_tokens)
    return run.stats


def _run_on_ray(items: Iterator[InputItem], remaining: int | None, model: str | None, device: str, dtype: str,
                quantize: str | None, options: dict[str, Any], settings: BatchSettings, field: str, chat: bool | None,
                writer: Callable[[list[dict]], None], progress: Progress, ray: "RayOptions") -> PipelineStats:
    """Generate on Ray actors; append each group of records that arrived in input order."""
    from ..integrations.ray_batch import quiet_ray_logs, ray_connection, ray_records

    stats = PipelineStats()
    predictor = dict(model=model, options=options, field=field, chat=chat, batch_size=settings.batch_size,
                     max_batch_tokens=settings.max_batch_tokens, device=device, dtype=dtype, quantize=quantize)
    if ray.address == "local" and model is not None and not Path(model).exists():
        raise ModelNotFoundError(f"model path {model} does not exist")  # before Ray starts actors that cannot load it
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


def batch_command(model_options: Callable, generation_options: Callable, handle_errors: Callable,
                  collect_options: Callable[[dict[str, Any]], dict[str, Any]]) -> click.Command:
    """Build the `batch` click command from fastdecode.cli's shared pieces."""

    @click.command("batch")
    @click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
    @click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
                  help="Output .jsonl (a regular file; - for stdout); if it exists, inputs already in it are "
                       "skipped (resume).")
    @click.option("--batch-size", type=int, default=None,
                  help="Prompts per batch (default 16). Excludes --max-batch-tokens.")
    @click.option("--max-batch-tokens", type=int, default=None,
                  help="Budget per batch: rows x (longest prompt + max new tokens).")
    @click.option("--lookahead", type=int, default=None,
                  help="Inputs sorted together by length (default 8 batches, or 256).")
    @click.option("--field", default="prompt", show_default=True, help="JSONL field that holds the prompt.")
    @click.option("--input-format", type=click.Choice(["auto", "jsonl", "txt"]), default="auto", show_default=True,
                  help="auto: by suffix (.jsonl / .txt), else by the first line.")
    @click.option("--chat/--no-chat", default=None,
                  help="Apply the model's chat template (default: on when the model has one).")
    @click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
    @click.option("--fail-fast", is_flag=True, help="Stop at the first failed input (exit 2).")
    @click.option("--overwrite", is_flag=True, help="Start again instead of resuming an existing output.")
    @click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None,
                  metavar="[ADDRESS|auto|local]",
                  help="Generate on Ray actors: local (the default value) starts a private Ray for the run, "
                       "auto joins this machine's cluster, or a cluster ADDRESS. Needs fastdecode[ray].")
    @click.option("--actors", type=int, default=1, show_default=True, help="With --ray: model replicas.")
    @click.option("--cpus-per-actor", type=int, default=1, show_default=True,
                  help="With --ray: CPUs (and torch threads) per replica.")
    @model_options
    @generation_options
    @handle_errors
    def batch(input_path: str, output: str, batch_size: int | None, max_batch_tokens: int | None,
              lookahead: int | None, field: str, input_format: str,
              chat: bool | None, quiet: bool, fail_fast: bool, overwrite: bool, ray_address: str | None, actors: int,
              cpus_per_actor: int, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
        """Generate for every line of INPUT (.jsonl or .txt, - for stdin) into OUTPUT (.jsonl).

        JSONL inputs are objects with a "prompt" (or --field) and an optional "id"; a .txt line
        is one prompt. Each output line is {"id", "line", "prompt", "output", "num_tokens",
        "finish_reason"} in input order (id defaults to the 0-based line index); a failed input
        gives {"id", "line", "error"}. Killed and restarted with the same command, the run
        resumes where it stopped. Exit code: 0 all ok, 1 some inputs failed, 2 bad usage.
        With --ray, --actors Ray actors (each --cpus-per-actor CPUs) generate; the output is the same.
        """
        options = collect_options(kwargs)  # --num-return-sequences > 1 makes each output a list
        settings = BatchSettings(batch_size=batch_size, max_batch_tokens=max_batch_tokens, lookahead=lookahead,
                                 fail_fast=fail_fast)
        ray = None
        if ray_address is not None:
            from ..integrations.ray_batch import RayOptions

            ray = RayOptions(address=ray_address, actors=actors, cpus_per_actor=cpus_per_actor)
        code = run_batch(input_path, output, model, device, dtype, options, settings, field, input_format, chat,
                         quiet, overwrite, ray, quantize=kwargs.get("quantize"))
        sys.exit(code)

    return batch
