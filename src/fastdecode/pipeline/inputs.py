"""Batch inputs: lines of a .jsonl / .txt file (or stdin), or Python objects -> numbered items.

Parsing never raises for a bad input: a malformed line becomes an ``InputItem`` with an
``error``, so that the run records it (with its line number) and goes on; whether to stop
instead (``--fail-fast``) is the pipeline's decision, taken in output order.

Numbering: ``line`` is the 1-based physical line number (blank lines count but are not inputs,
so that the number is what an editor shows); an input without an ``id`` gets ``id = line - 1``,
its 0-based line index, so ids never shift when blank lines are added or removed elsewhere.
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config.generation import GenerationConfig
from ..errors import BatchFileError

FORMATS = ("jsonl", "txt")
BOM = "\ufeff"  # a UTF-8 byte order mark, as some editors write at the start of a file
# Byte order marks of the encodings a text file is decoded by instead of UTF-8 (UTF-32 first:
# its little-endian mark begins with UTF-16's).
WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
             (codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16"))


@dataclass(slots=True)
class InputItem:
    """One input on its way through the pipeline (slots: 100k of them in flight must stay cheap)."""

    line: int  # 1-based line number (position, for Python inputs)
    id: Any = None  # the input's id; line - 1 when it has none; None when unknown (unparsable line)
    prompt: Any = None  # str, or a chat conversation (list of {"role", "content"} dicts)
    error: str | None = None  # why this input cannot be generated
    ids: list[int] | None = None  # prompt token ids (filled by the tokenize stage)
    seq: int = 0  # 0-based position among this run's inputs: the output order
    response_format: Any = None  # the input's own output constraint (constraints/forms.py), or None


def format_for(path: str, first_line: str) -> str:
    """The input format: from the file suffix, else sniffed from the first non-blank line."""
    lowered = path.lower()
    if lowered.endswith(".jsonl") or lowered.endswith(".ndjson"):
        return "jsonl"
    if lowered.endswith(".txt"):
        return "txt"
    return "jsonl" if first_line.lstrip().startswith("{") else "txt"


def wide_encoding(head: bytes) -> str | None:
    """"utf-16" / "utf-32" when ``head`` (a file's first bytes) starts with that byte order mark."""
    return next((name for bom, name in WIDE_BOMS if head.startswith(bom)), None)


def text_lines(handle: Any) -> Iterator[str | bytes]:
    """A binary file's lines: bytes (decoded later, line by line, as UTF-8), or str when the file
    starts with a UTF-16 / UTF-32 byte order mark (decoded here by that encoding, which drops the
    mark; a decoding error refuses the file, naming the encoding)."""
    if not hasattr(handle, "peek"):  # e.g. an in-memory stdin
        handle = io.BufferedReader(handle)
    encoding = wide_encoding(handle.peek(4)[:4])
    if encoding is None:
        yield from handle
        return
    text = io.TextIOWrapper(handle, encoding=encoding, newline="\n")
    line = 0
    try:
        for line, decoded in enumerate(text, start=1):
            yield decoded
    except UnicodeDecodeError as exc:
        raise BatchFileError(f"the input starts with a {encoding.upper()} byte order mark but line {line + 1} is "
                             f"not valid {encoding.upper()} ({exc.reason})") from None
    finally:
        text.detach()  # the caller closes the file


def _check_text(text: str) -> None:
    if "\0" in text:
        raise BatchFileError("the prompt contains NUL characters (U+0000): is the file UTF-16 or binary "
                             "without a byte order mark?")


def check_prompt(prompt: Any) -> None:
    """Raise BatchFileError unless ``prompt`` is a non-empty string or a chat conversation (no NULs)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BatchFileError("empty prompt")
        _check_text(prompt)
        return
    if isinstance(prompt, list) and prompt:
        for message in prompt:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise BatchFileError('a chat prompt must be a list of {"role": str, "content": str} objects')
            _check_text(message["content"])
        return
    if isinstance(prompt, list):
        raise BatchFileError("empty chat prompt")
    raise BatchFileError(f"the prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def check_id(value: Any) -> None:
    """An id is written back as strict JSON: NaN and infinities (``1e999``) cannot be."""
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise BatchFileError("the id is NaN or infinite, which JSON cannot hold: give a string or a finite "
                             "number") from None
    except (TypeError, RecursionError) as exc:
        raise BatchFileError(f"the id cannot be written as JSON ({exc})") from None


# Names that read as generation options on an input line (GenerationConfig's, and OpenAI's max_tokens): a
# line may set response_format only; other fields (metadata a dataset carries) are left alone.
LINE_OPTION_NAMES = {f.name for f in dataclasses.fields(GenerationConfig)} | {"max_tokens"}


def item_from_object(value: Any, line: int, field: str = "prompt") -> InputItem:
    """A str / chat list / dict with ``field`` and optional ``id`` -> an item (with ``error`` if bad)."""
    if isinstance(value, dict):
        item = InputItem(line=line, id=value.get("id", line - 1))
        try:
            check_id(item.id)
        except BatchFileError as exc:
            item.id, item.error = None, str(exc)
            return item
        if field not in value:
            item.error = f"missing field {field!r}"
            return item
        item.prompt = value[field]
        item.response_format = value.get("response_format")
        options = sorted(set(value) & LINE_OPTION_NAMES - {field, "response_format"})
        if options:  # a line's own options other than its constraint are not read: never silently dropped
            item.error = (f"a line may carry its own response_format only, not {', '.join(options)}: set the "
                          "other options for the whole run (command-line flags, or batch()'s keywords)")
            return item
    else:
        item = InputItem(line=line, id=line - 1, prompt=value)
    try:
        check_prompt(item.prompt)
    except BatchFileError as exc:
        item.error, item.prompt = str(exc), None
    return item


def parse_json_line(text: str, line: int, field: str = "prompt") -> InputItem:
    """One .jsonl line -> an item; bad JSON or a non-object gives an item whose id is unknown.

    Whatever the parser raises (bad syntax, an integer over Python's digit limit, nesting deeper
    than the recursion limit) is this line's error: one line never stops the run.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return InputItem(line=line, error=f"invalid JSON: {exc}")
    except RecursionError:
        return InputItem(line=line, error="invalid JSON: nested too deeply")
    except (ValueError, OverflowError) as exc:  # e.g. "Exceeds the limit (4300 digits) ..."
        return InputItem(line=line, error=f"invalid JSON: {exc}")
    if not isinstance(value, dict):
        return InputItem(line=line, error=f"expected a JSON object, got {type(value).__name__}")
    return item_from_object(value, line, field)


def parse_text_line(text: str, line: int) -> InputItem:
    """One .txt line is one prompt, taken as is (only the line break is removed)."""
    return item_from_object(text.rstrip("\r\n"), line)


def items_from_lines(lines: Iterable[str | bytes], fmt: str, field: str = "prompt") -> Iterator[InputItem]:
    """Lines (str, or bytes decoded here as UTF-8) -> items, blank lines skipped but counted.

    Bytes are decoded line by line so that one line of bad UTF-8 is one failed input, not a
    crash of the whole run. A byte order mark at the start of line 1 is dropped.
    """
    if fmt not in FORMATS:
        raise BatchFileError(f"unknown input format {fmt!r}; expected one of {', '.join(FORMATS)}")
    for line, text in enumerate(lines, start=1):
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield InputItem(line=line, error=f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
        if line == 1:
            text = text.removeprefix(BOM)
        if not text.strip():
            continue
        yield parse_json_line(text, line, field) if fmt == "jsonl" else parse_text_line(text, line)


def items_from_objects(values: Iterable[Any], field: str = "prompt") -> Iterator[InputItem]:
    """Python inputs (Generator.batch) -> items numbered 1, 2, ... like lines.

    Checked eagerly (this is not a generator function) so that a single prompt passed by mistake
    fails at the call, not later in the reader thread.
    """
    if isinstance(values, (str, dict)) or not isinstance(values, Iterable):
        raise BatchFileError("batch() takes an iterable of inputs (strings, chat lists or dicts), not a single prompt")
    return (item_from_object(value, line, field) for line, value in enumerate(values, start=1))


def skip_done(items: Iterable[InputItem], done: int, last_record: dict | None) -> Iterator[InputItem]:
    """Skip the ``done`` inputs an earlier run already wrote, checking the last one matches.

    The check (same line number and id as the last record in the output) catches resuming an
    output file with a different input, which would otherwise silently mix two runs.
    """
    iterator = iter(items)
    last: InputItem | None = None
    for count in range(done):
        last = next(iterator, None)
        if last is None:
            raise BatchFileError(
                f"the output already holds {done} records but the input has only {count}: "
                "is it the output of another input? (--overwrite starts again)"
            )
    if done and last_record is not None:
        same_line = last_record.get("line") == last.line
        same_id = "id" not in last_record or last.id is None or last_record["id"] == last.id
        if not (same_line and same_id):
            raise BatchFileError(
                f"the output's last record (line {last_record.get('line')}, id {last_record.get('id')!r}) does "
                f"not match input {done} (line {last.line}, id {last.id!r}): is it the output of another "
                "input? (--overwrite starts again)"
            )
    yield from iterator
