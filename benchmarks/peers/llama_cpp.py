"""llama.cpp as a peer, through its own ``llama-server`` binary (built by build_llama_cpp.sh): load time,
first token, RSS, and tokens/s at batch 1 and 8 and prompt processing through its parallel slots
(quantized_speed.py); the same server under load (serve_load.py).

The binary folder: ``--llama-cpp-bin DIR``, else ``$LLAMA_CPP_BIN``, else build_llama_cpp.sh's default
cache. A missing binary is reported with the reason, never estimated.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harness import stop_process

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


def server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int,
                   context_per_slot: int, extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server on ``gguf`` with ``parallel`` slots and continuous batching (``extra``: more flags)."""
    return [str(binary), "-m", str(gguf), "--port", str(port), "-t", str(threads), "-tb", str(threads),
            "-np", str(parallel), "-c", str(context_per_slot * parallel), "--cont-batching", "--no-webui", *extra]


class ServerPeer:
    """llama-server with ``parallel`` slots, looking like a harness.Worker to the parent.

    ``ready``: seconds from process start to a ready ``/health`` (load_s) and to the answer of a
    1-token completion of ``first_prompt`` (first_token_s), and the RSS then (rss_kib).
    ``call("generate", prompts, new_tokens)`` sends every prompt at once as its own ``/completion``
    request (token ids, greedy, ``ignore_eos``, exactly ``new_tokens``, no prompt cache), so up to
    ``parallel`` sequences are decoded together (continuous batching), and times until the last answer;
    its rows are the generated token ids. ``peak_rss_kib()``: the server's VmHWM so far.
    """

    def __init__(self, binary: Path, gguf: Path, threads: int, first_prompt: list[int], parallel: int = 8,
                 context_per_slot: int = 1024, timeout: float = 300.0, extra: tuple[str, ...] = ()):
        self.name, self.timeout = "llama.cpp", timeout
        port = free_port()
        launched = time.time()
        self.process = subprocess.Popen(server_command(binary, gguf, port, threads, parallel, context_per_slot,
                                                                       extra),
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        try:
            self._wait_ready(launched)
            loaded = time.time()
            self._complete(first_prompt, 1)
            first = time.time()
        except BaseException:
            self.close()
            raise
        self.ready = {"load_s": loaded - launched, "first_token_s": first - launched, "rss_kib": self._status("VmRSS")}

    def _wait_ready(self, launched: float) -> None:
        while True:
            if self.process.poll() is not None or time.time() - launched > self.timeout:
                raise RuntimeError(f"llama-server did not start (exit code {self.process.poll()})")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.05)

    def _complete(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        body = json.dumps({"prompt": prompt, "n_predict": new_tokens, "temperature": 0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False, "return_tokens": True}).encode()
        request = urllib.request.Request(self.base + "/completion", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            return json.loads(response.read())

    def _status(self, field: str) -> int:
        status = Path(f"/proc/{self.process.pid}/status")
        found = re.search(rf"^{field}:\s+(\d+)", status.read_text(), re.M) if status.exists() else None
        return int(found.group(1)) if found else 0

    def _cpu_seconds(self) -> float:
        stat = Path(f"/proc/{self.process.pid}/stat")
        if not stat.exists():
            return 0.0
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def call(self, op: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        assert op == "generate", op
        cpu_before, started = self._cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda prompt: self._complete(prompt, new_tokens), prompts))
        seconds = time.perf_counter() - started
        counts = [answer["tokens_predicted"] for answer in answers]
        if any(count != new_tokens for count in counts):
            raise RuntimeError(f"llama-server produced {counts} tokens, not {new_tokens} each")
        return {"seconds": seconds, "cpu_s": self._cpu_seconds() - cpu_before,
                "rows": [answer.get("tokens") for answer in answers]}

    def completions(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[dict[str, Any]], float]:
        """Every prompt at once as ``call`` sends them -> (the answers, with llama-server's own ``timings``:
        ``predicted_n`` / ``predicted_ms`` after the prompt, and ``draft_n`` / ``draft_n_accepted`` when it
        speculates; the server's CPU seconds over the call)."""
        cpu_before = self._cpu_seconds()
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda prompt: self._complete(prompt, new_tokens), prompts))
        return answers, self._cpu_seconds() - cpu_before

    def peak_rss_kib(self) -> int:
        return self._status("VmHWM")

    def close(self) -> None:
        stop_process(self.process)
