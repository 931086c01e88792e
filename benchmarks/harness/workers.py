"""Engines in worker processes: ``Worker`` in the parent, ``serve_worker`` in the child, one JSON
line per request; ``alternate_workers`` runs every job on every engine in turn, each call with the
cores other processes kept busy meanwhile."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .machine import Contention, cpu_seconds, memory_kib, quiet_env, reset_peak_rss, wait_for_quiet


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden flags a script's worker is started with."""
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)


class WorkerError(RuntimeError):
    pass


class Worker:
    """Parent side of one engine's process: ``script --worker NAME --options JSON``, JSON lines.

    ``env``: the worker's environment (default ``quiet_env()``; e.g. another tree's src on PYTHONPATH).
    ``ready`` is the worker's first line: load_s (from the launch: interpreter, imports, load), engine_s
    (building the engine after torch is imported: its own imports and load), torch's version and
    threads, and whatever the engine's ``ready_info()`` adds.
    """

    def __init__(self, script: str | Path, name: str, options: dict[str, Any], log_dir: Path,
                 env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_dir / f"{name.replace('/', '_')}.log"
        self._log = self.log_path.open("w")
        options = {**options, "launched_at": time.time()}
        command = [sys.executable, str(script), "--worker", name, "--options", json.dumps(options)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env or quiet_env())
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> dict[str, Any]:
        self.ready = self._read()
        return self.ready

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-2000:]
            raise WorkerError(f"{self.name} worker exited (code {self.proc.returncode}):\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.name}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_workers(script: str | Path, wanted: dict[str, dict[str, Any]], log_dir: Path,
                  required: Iterable[str] = (), one_at_a_time: bool = False) -> tuple[dict[str, Worker], dict[str, str]]:
    """Start every worker at once (loads overlap), or ``one_at_a_time`` (each ready before the next
    starts: load and first-token times are then each engine's own), wait for each; those that fail
    are returned with why (a ``required`` one that fails raises)."""
    workers = {} if one_at_a_time else {name: Worker(script, name, options, log_dir) for name, options in wanted.items()}
    failed: dict[str, str] = {}
    for name in list(wanted):
        try:
            if one_at_a_time:
                workers[name] = Worker(script, name, wanted[name], log_dir)
            workers[name].wait_ready()
        except WorkerError as exc:
            if name in required:
                raise
            print(f"skipping {name}: {exc}", file=sys.stderr)
            worker = workers.pop(name, None)
            if worker is not None:
                worker.close()
            failed[name] = str(exc).splitlines()[-1][:200]
    return workers, failed


def stop_process(process: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def close_all(workers: dict[str, Worker]) -> None:
    for worker in workers.values():
        worker.close()


def alternate_workers(workers: dict[str, Worker], jobs: dict[str, dict[str, Any]], reps: int,
                      quiet_wait: float = 0.0, warmup: bool = False) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every engine runs every job (label -> ``generate`` request) once per repetition, engines in turn;
    ``warmup``: one untimed repetition first (first calls pay for page faults, allocator growth, lazy
    set-up: the first-token time already shows that cost).

    Returns name -> label -> the replies (seconds, cpu_s, rows), each with ``other_cores``: the cores
    other processes kept busy during that call.
    """
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {j: [] for j in jobs} for n in workers}
    for rep in range(-1 if warmup else 0, reps):
        for label, request in jobs.items():
            for name, worker in workers.items():
                wait_for_quiet(quiet_wait)
                meter = Contention()
                reply = worker.call("generate", **request)
                reply["other_cores"] = meter.other_cores(reply["cpu_s"])
                if rep >= 0:
                    runs[name][label].append(reply)
                print(f"  rep {rep + 1 if rep >= 0 else 'warm-up'}/{reps} {label:<12} {name:<20} {reply['seconds']:8.3f} s "
                      f"(other processes: {reply['other_cores']:.1f} cores busy)", file=sys.stderr, flush=True)
    return runs


def serve_worker(engine_factory: Callable[[dict[str, Any]], Any], options: dict[str, Any]) -> None:
    """The child side: build the engine, then answer JSON-line requests on stdin until ``exit``.

    Replies go to the real stdout; anything the libraries print goes to stderr (the log file).
    Ops: ``generate`` (timed: seconds, cpu_s, rows), ``mark_loaded`` (remember RSS, restart the peak),
    ``memory``, and ``NAME`` -> the engine's ``op_NAME(**args)``.
    """
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(options["threads"])
    built = time.perf_counter()
    engine = engine_factory(options)
    ready = {"load_s": time.time() - options.get("launched_at", time.time()), "engine_s": time.perf_counter() - built,
             "threads": torch.get_num_threads(), "torch": torch.__version__}
    ready.update(engine.ready_info() if hasattr(engine, "ready_info") else {})
    protocol.write(json.dumps(ready) + "\n")
    state: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            reply = _handle(engine, state, op, request)
        except Exception as exc:  # reported to the parent, which decides what to skip
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")


def _handle(engine: Any, state: dict[str, Any], op: str, args: dict[str, Any]) -> dict[str, Any]:
    if op == "generate":
        cpu_before, started = cpu_seconds(), time.perf_counter()
        rows = engine.generate(**args)
        return {"seconds": time.perf_counter() - started, "cpu_s": cpu_seconds() - cpu_before, "rows": rows}
    if op == "mark_loaded":
        state["loaded"], state["peak_reset"] = memory_kib(), reset_peak_rss()
        return {}
    if op == "memory":
        return {"loaded": state.get("loaded"), "now": memory_kib(), "peak_reset": state.get("peak_reset")}
    return getattr(engine, f"op_{op}")(**args)


def run_in_tree(command: list[str], tree: str) -> dict[str, Any]:
    """Runs a one-shot worker ``command`` with ``PYTHONPATH`` set to the source folder ``tree`` and returns the
    JSON object of its last output line, which must name (key ``tree``) a fastdecode imported from that folder."""
    done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: worker failed\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["tree"].startswith(tree):
        raise SystemExit(f"{tree}: fastdecode was imported from {result['tree']}")
    return result
