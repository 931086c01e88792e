"""The .jsonl output file: locked, resumed (torn last line, records already written), appended to.

Crash safety rests on three facts: records are written in input order, each record is one line
whose only newline is its last character (JSON escapes the others), flushed as soon as it is in
order, and so a line is complete exactly when it ends with a newline. So after a kill at any moment
the file is N complete records (the first N inputs) plus possibly the start of one more line, which
a restart cuts off before skipping the first N inputs.

Two runs on one output would interleave their records, so the file is held under an exclusive
``flock`` for the whole run (released by the kernel when the process dies, even by kill -9); a
second run exits naming the holder's PID (from /proc/locks). Only regular files are accepted: a
device such as /dev/zero would otherwise be scanned as one endless line. Existing records are read
with bounded line lengths for the same reason.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import BatchFileError, OutputWriteError
from .records import is_error

MAX_RECORD_BYTES = 64 << 20  # the longest output line a resume scan accepts
# Write errors that leave the file intact but stop the run (the user can fix and resume).
RESUMABLE_WRITE_ERRORS = (errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG, errno.EROFS)


@dataclass
class OutputState:
    """What an earlier run left in the output file."""

    done: int = 0  # complete records: the first ``done`` inputs are finished
    failed: int = 0  # how many of them are error records
    last: dict[str, Any] | None = None  # the last complete record (to check the input matches)
    truncated_bytes: int = 0  # size of the torn last line that was cut off


def same_file(a: os.stat_result, b: os.stat_result) -> bool:
    """Two names (or descriptors) for one file, hard links included."""
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def lock_holder(st: os.stat_result) -> int | None:
    """PID of the process holding a flock on the file ``st`` describes, from /proc/locks (Linux)."""
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            for line in handle:
                fields = line.split()
                if "->" in fields:  # a waiter, not the holder
                    continue
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == key:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


def _cut_torn_tail(handle: BinaryIO) -> int:
    size = os.fstat(handle.fileno()).st_size
    position, chunk, keep = size, 1 << 16, 0
    while position > 0:
        start = max(0, position - chunk)
        handle.seek(start)
        block = handle.read(position - start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        position = start
    if keep < size:
        handle.truncate(keep)
    return size - keep


def cut_torn_tail(path: Path) -> int:
    """Truncate ``path`` after its last newline; return how many bytes were cut (0 if none)."""
    with open(path, "rb+") as handle:
        return _cut_torn_tail(handle)


def _scan_records(handle: BinaryIO, path: Path) -> OutputState:
    """Count the complete records; every line must be a JSON object with a ``line``."""
    state = OutputState()
    handle.seek(0)
    number = 0
    while raw := handle.readline(MAX_RECORD_BYTES + 1):
        number += 1
        if len(raw) > MAX_RECORD_BYTES:
            raise BatchFileError(f"{path} line {number} is longer than {MAX_RECORD_BYTES} bytes: not a fastdecode "
                                 "batch output (use another output file, or --overwrite)")
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):
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


def encode_record(record: dict[str, Any]) -> bytes:
    """One line of output: strict JSON (no NaN / Infinity); ensure_ascii=False keeps text readable.

    A record that cannot be strict JSON (a ``postprocess`` hook put a NaN in it) is written as an
    error record for its line instead, so the file always stays valid and resumable.
    """
    try:
        text = json.dumps(record, ensure_ascii=False, allow_nan=False)
        return (text + "\n").encode("utf-8")
    except (ValueError, TypeError, RecursionError) as exc:
        fallback = {"line": record.get("line"), "error": f"the record cannot be written as JSON: {exc}"}
        return (json.dumps(fallback, allow_nan=False) + "\n").encode("utf-8")


class OutputFile:
    """The output of one run: locked, made ready to append to, then appended to (``__call__``).

    ``state`` says what an earlier run left (the inputs to skip). ``fsync`` makes each group
    durable against power loss too (a kill -9 never loses written data: the OS holds it); off by
    default because it costs a disk round trip per group. Writes go straight to the descriptor
    (no buffer), so a failed write never leaves data to be flushed, half, at close.
    """

    def __init__(self, path: str | Path, overwrite: bool = False, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
        self.written = 0
        self.handle = self._open_locked()
        try:
            self.state = self._prepare(overwrite)
        except BaseException:
            self.close()
            raise

    def _open_locked(self) -> BinaryIO:
        path = self.path
        try:
            existing = os.stat(path)
        except FileNotFoundError:
            existing = None
        except OSError as exc:
            raise BatchFileError(f"cannot use output {path}: {exc.strerror}") from exc
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            kind = "a directory" if stat.S_ISDIR(existing.st_mode) else "not a regular file"
            raise BatchFileError(f"output {path} is {kind}: give a regular file (or - for stdout)")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path, "a+b", buffering=0)
        except OSError as exc:
            raise BatchFileError(f"cannot write output {path}: {exc.strerror}") from exc
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = lock_holder(os.fstat(handle.fileno()))
            handle.close()
            who = f"process {pid}" if pid is not None else "another process"
            raise BatchFileError(f"output {path} is in use by {who} (another fastdecode batch run?): wait for it "
                                 "to finish, or write to another file") from None
        return handle

    def _prepare(self, overwrite: bool) -> OutputState:
        if overwrite:
            self.handle.truncate(0)
            return OutputState()
        cut = _cut_torn_tail(self.handle)
        state = _scan_records(self.handle, self.path)
        state.truncated_bytes = cut
        return state

    def __call__(self, records: list[dict[str, Any]]) -> None:
        data = b"".join(encode_record(record) for record in records)
        try:
            view = memoryview(data)
            while view:
                view = view[self.handle.write(view):]
            if self.fsync:
                os.fsync(self.handle.fileno())
        except OSError as exc:
            if exc.errno in RESUMABLE_WRITE_ERRORS:
                raise OutputWriteError(
                    f"cannot write to {self.path}: {exc.strerror}. The {self.state.done + self.written} records "
                    "already written are intact: fix the cause and rerun the same command to resume"
                ) from None
            raise
        self.written += len(records)

    def close(self) -> None:
        self.handle.close()  # closing the descriptor releases the lock

    def __enter__(self) -> "OutputFile":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def prepare_output(path: str | Path, overwrite: bool = False) -> OutputState:
    """Make ``path`` ready to append to (create or empty it, or cut its torn tail and scan it)."""
    with OutputFile(path, overwrite) as output:
        return output.state
