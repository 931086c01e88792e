"""How every subcommand fails: a ``FastDecodeError`` is one line on stderr and exit code 2 (the same
code click uses for usage errors; an error's own ``exit_code`` where it has one), never a traceback.
A closed standard stream a command needs is such an error; a write error on stdout (a full disk,
/dev/full) is one line and exit code 1. A closed pipe (``fastdecode generate ... | head -1``) means
the reader has read all it wants: a quiet exit with SIGPIPE's status, 141, as ``cat`` or ``grep``."""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys

from ..errors import FastDecodeError, InvalidOptionError

# Errors writing stdout that are the environment's, not a bug: one line, exit 1.
WRITE_ERRORS = (errno.EBADF, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def say(message: str) -> None:
    """One line on stderr, if there is a stderr."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
    except OSError:
        pass


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so that the interpreter's final flush cannot fail (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def require_stream(name: str) -> None:
    """Raise a typed error when standard input / output (``name``: "stdin" or "stdout") is closed."""
    if getattr(sys, name) is None:
        what = {"stdin": "input", "stdout": "output"}[name]
        raise InvalidOptionError(f"standard {what} is closed: this command needs it")


def handle_errors(command):
    """Wrap a command body: typed errors, Ctrl-C and write errors become one line and an exit code."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FastDecodeError as exc:
            say(f"error: {exc}")
            sys.exit(getattr(exc, "exit_code", 2))
        except KeyboardInterrupt:
            say("")
            sys.exit(130)
        except OSError as exc:
            if exc.errno == errno.EPIPE:  # the reader closed the pipe: nothing more to say to it
                _silence_stdout()
                sys.exit(128 + signal.SIGPIPE)
            if exc.errno not in WRITE_ERRORS:
                raise
            _silence_stdout()
            say(f"error: cannot write the output: {exc.strerror or exc}")
            sys.exit(1)

    return wrapper
