"""The .jsonl output file: resuming it (torn last line, records already written) and appending.

Crash safety rests on three facts: records are written in input order, each record is one line
whose only newline is its last character (JSON escapes the others), flushed as soon as it is in
order, and so a line is complete exactly when it ends with a newline. So after a kill at any moment the file is N complete records
(the first N inputs) plus possibly the start of one more line, which a restart cuts off before
skipping the first N inputs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ..errors import BatchFileError
from .records import is_error


@dataclass
class OutputState:
    """What an earlier run left in the output file."""

    done: int = 0  # complete records: the first ``done`` inputs are finished
    failed: int = 0  # how many of them are error records
    last: dict[str, Any] | None = None  # the last complete record (to check the input matches)
    truncated_bytes: int = 0  # size of the torn last line that was cut off


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline; return how many bytes were cut (0 if none)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as handle:
        position, chunk = size, 1 << 16
        while position > 0:
            start = max(0, position - chunk)
            handle.seek(start)
            block = handle.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            position = start
        else:
            keep = 0
        if keep < size:
            handle.truncate(keep)
        return size - keep


def scan_records(path: Path) -> OutputState:
    """Count the complete records of an output file; every line must be a JSON object."""
    state = OutputState()
    with open(path, encoding="utf-8") as handle:
        for number, text in enumerate(handle, start=1):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict) or "line" not in record:
                raise BatchFileError(
                    f"{path} line {number} is not a fastdecode batch record; refusing to append to it "
                    "(use another output file, or --overwrite)"
                )
            state.done += 1
            state.failed += is_error(record)
            state.last = record
    return state


def prepare_output(path: str | Path, overwrite: bool = False) -> OutputState:
    """Make ``path`` ready to append to: create or empty it, or cut its torn tail and scan it."""
    path = Path(path)
    if path.is_dir():
        raise BatchFileError(f"output {path} is a directory")
    if overwrite or not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
        except OSError as exc:
            raise BatchFileError(f"cannot write output {path}: {exc.strerror}") from exc
        return OutputState()
    cut = cut_torn_tail(path)
    state = scan_records(path)
    state.truncated_bytes = cut
    return state


def encode_record(record: dict[str, Any]) -> str:
    """One line of output; ensure_ascii=False keeps non-English text readable in the file."""
    return json.dumps(record, ensure_ascii=False) + "\n"


class JsonlWriter:
    """Appends records to the output, flushing after each group (one call per group of records).

    ``fsync`` makes each group durable against power loss too (a kill -9 never loses flushed
    data: the OS holds it); off by default because it costs a disk round trip per group.
    """

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
        self.handle: IO[str] = open(self.path, "a", encoding="utf-8")

    def __call__(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.handle.write(encode_record(record))
        self.handle.flush()
        if self.fsync:
            os.fsync(self.handle.fileno())

    def close(self) -> None:
        self.handle.close()
