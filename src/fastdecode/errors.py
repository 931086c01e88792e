"""Typed errors: every bad input a user can cause maps to one of these.

The CLI prints ``str(error)`` (no traceback) and exits with code 2 for any
``FastDecodeError`` (or the error's ``exit_code`` where it has one).
"""

from __future__ import annotations


class FastDecodeError(Exception):
    """Base class of every error fastdecode raises on purpose."""


class ModelNotFoundError(FastDecodeError):
    """The model source (path, file, default package) does not exist."""


class CheckpointError(FastDecodeError):
    """A checkpoint exists but cannot be read: corrupt, truncated, missing or unexpected weights."""


class UnsupportedModelError(FastDecodeError):
    """The architecture or one of its options is not supported."""


class TokenizerError(FastDecodeError):
    """No usable tokenizer, or a tokenizer that does not match the model."""


class InvalidOptionError(FastDecodeError, ValueError):
    """A generation option is out of range or not supported together with others. ``option``: the
    input it names where that is one field of a request ("prompt"), which the server answers as its param."""

    def __init__(self, message: str, option: str | None = None):
        super().__init__(message)
        self.option = option


class PromptTooLongError(FastDecodeError):
    """A prompt (plus requested new tokens) does not fit in the model's context."""


class QueueFullError(FastDecodeError):
    """The engine's queue of waiting sequences is full: retry later (the server answers 503)."""


class GenerationCancelledError(FastDecodeError):
    """A generation was stopped by its caller's ``should_stop`` (e.g. the server's client went away)."""


class BatchFileError(FastDecodeError):
    """A batch input line is malformed, or an output file cannot be resumed for this input.

    In a ``fastdecode batch`` run a malformed line becomes an error record and the run goes on;
    this error is raised only with ``--fail-fast`` (or ``fail_fast=True``) and for an output file
    that does not belong to the input (resuming it would mix two runs).
    """


class OutputWriteError(FastDecodeError):
    """Writing results failed for a reason outside the input (disk full, I/O error); what was
    written is intact and the run can be resumed. The CLI exits with ``exit_code`` (3)."""

    exit_code = 3


class MemoryLimitError(FastDecodeError, ValueError):
    """A request needs more memory than the limit (available memory, or ``max_memory``); raised
    before anything is allocated, naming the option that makes it large."""


class InvalidPromptError(InvalidOptionError):
    """A prompt of the wrong type (bytes, None, a number, a flat list where a list of prompts is
    expected) or text that is not valid Unicode (a lone surrogate, undecodable bytes)."""


class RayUnavailableError(FastDecodeError):
    """``--ray`` / ``fastdecode.integrations.ray``: Ray is not installed, or the cluster cannot be reached."""


class AudioError(FastDecodeError):
    """An audio input that cannot be decoded: not audio, no audio stream, a corrupt file."""
