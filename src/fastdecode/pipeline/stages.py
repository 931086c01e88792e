"""The pipeline's threads: one stop flag and first error for the whole run, queue calls that give
up when the run stops, and stages started as daemon threads that report what they raise."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

POLL_S = 0.05  # how often a blocked stage checks whether the run was stopped


class Stopped(Exception):
    """Raised inside a stage when another stage stopped the run."""


END = object()  # the last item a stage puts on a queue


class StageControl:
    """The run's shared stop flag and first error; blocking queue calls that honour the flag."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = error
        self.stop.set()

    def put(self, channel: queue.Queue, value: Any) -> None:
        while not self.stop.is_set():
            try:
                channel.put(value, timeout=POLL_S)
                return
            except queue.Full:
                pass
        raise Stopped

    def get(self, channel: queue.Queue) -> Any:
        while not self.stop.is_set():
            try:
                return channel.get(timeout=POLL_S)
            except queue.Empty:
                pass
        raise Stopped

    def run_stage(self, stage: Callable[[], None], name: str) -> threading.Thread:
        """Start ``stage`` in a daemon thread that reports any exception here and stops the run."""
        def body() -> None:
            try:
                stage()
            except Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self.fail(exc)

        # Daemon: a reader blocked on a silent stdin must not keep the process alive.
        thread = threading.Thread(target=body, name=f"fastdecode-{name}", daemon=True)
        thread.start()
        return thread
