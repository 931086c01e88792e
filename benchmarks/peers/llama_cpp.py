"""llama.cpp as a peer, through its own binaries (built by build_llama_cpp.sh): ``llama-batched-bench``
for tokens/s at batch 1 and 8 and prompt processing, ``llama-server`` for load time, first token and RSS
(and for serve_load.py's parallel slots).

The binary folder: ``--llama-cpp-bin DIR``, else ``$LLAMA_CPP_BIN``, else build_llama_cpp.sh's default
cache. A missing binary is reported with the reason, never estimated.
"""

from __future__ import annotations

import json
import os
import re
import resource
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fastdecode-bench/llama.cpp/build/bin"
BUILD_HINT = "build it with benchmarks/peers/build_llama_cpp.sh, or pass --llama-cpp-bin / set LLAMA_CPP_BIN"


def bin_dir(option: str | None = None) -> Path:
    return Path(option or os.environ.get("LLAMA_CPP_BIN") or DEFAULT_BIN)


def find_binary(name: str, folder: Path) -> tuple[Path | None, str | None]:
    """(path, None) when ``folder/name`` is an executable, else (None, why not)."""
    path = folder / name
    if path.is_file() and os.access(path, os.X_OK):
        return path, None
    return None, f"no {name} in {folder} ({BUILD_HINT})"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BatchedBench:
    """Looks like a harness.Worker to the parent: ``call("generate", prompts, new_tokens)`` runs one
    ``llama-batched-bench`` process for that shape (B sequences of the prompt's length, random tokens,
    its own prompt each) and returns its own timers: the prompt pass plus ``new_tokens - 1`` decode steps
    (the first new token comes from the prompt pass, as in fastdecode's generate). The model load of
    each process is not timed."""

    def __init__(self, binary: Path, gguf: Path, threads: int):
        self.name, self.binary, self.gguf, self.threads = "llama.cpp", binary, gguf, threads
        self.ready: dict[str, Any] = {}

    def call(self, op: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        assert op == "generate", op
        batch, length, steps = len(prompts), len(prompts[0]), new_tokens - 1
        command = [str(self.binary), "-m", str(self.gguf), "-c", str(batch * (length + new_tokens) + 16),
                   "-b", "2048", "-ub", "512", "-npp", str(length), "-ntg", str(steps), "-npl", str(batch),
                   "-t", str(self.threads), "-tb", str(self.threads), "--output-format", "jsonl"]
        cpu_before = _children_cpu_seconds()
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"llama-batched-bench failed ({done.returncode}): {done.stderr[-500:]}")
        result = json.loads(re.sub(r"\b-?(nan|inf)\b", "null", lines[-1]))
        return {"seconds": result["t_pp"] + (result["t_tg"] or 0.0), "cpu_s": _children_cpu_seconds() - cpu_before,
                "rows": None, "llama": result}

    def close(self) -> None:
        pass


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                   context_per_slot: int) -> list[str]:
    """llama-server on ``gguf`` with ``parallel`` slots and continuous batching."""
    return [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-np", str(parallel), "-c", str(context_per_slot * parallel), "--cont-batching", "--no-webui"]


def server_start(binary: Path, gguf: Path, threads: int, prompt: list[int], timeout: float = 120.0) -> dict[str, Any]:
    """Start llama-server (1 slot): seconds from process start to a ready /health (load_s) and to the
    first token of a 1-token completion of ``prompt`` (first_token_s), and its RSS then (rss_kib)."""
    port = free_port()
    launched = time.time()
    process = subprocess.Popen(server_command(binary, gguf, port, threads, 1, 1024), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if process.poll() is not None or time.time() - launched > timeout:
                raise RuntimeError(f"llama-server did not start (exit code {process.poll()})")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.05)
        loaded = time.time()
        body = json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False}).encode()
        request = urllib.request.Request(base + "/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
        first = time.time()
        status = Path(f"/proc/{process.pid}/status")
        rss = re.search(r"^VmRSS:\s+(\d+)", status.read_text(), re.M) if status.exists() else None
        return {"load_s": loaded - launched, "first_token_s": first - launched,
                "rss_kib": int(rss.group(1)) if rss else 0}
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
