"""The memory-bandwidth limit: read bandwidth measured three ways in a subprocess (the caller never
imports torch), and the tokens per second it allows when every token reads its bytes once.
``python -m harness.bandwidth THREADS TRIALS [WAYS]`` (from benchmarks/; WAYS: some of ``BANDWIDTH_LABELS``'s keys,
comma-separated, all by default) prints the measurement as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .machine import quiet_env, wait_for_quiet
from .stats import timed


BANDWIDTH_LABELS = {"sum": "torch.sum over 1 GiB fp32", "gemv_x_at_w": "GEMV x @ W, W [K,N] 1 GiB",
                    "gemv_linear": "GEMV F.linear(x, W) = x @ W.T, W [N,K] 1 GiB"}


def measure_bandwidth(threads: int, trials: int = 3, quiet_wait: float = 0.0,
                      ways: tuple[str, ...] = tuple(BANDWIDTH_LABELS)) -> dict[str, float]:
    """Memory read bandwidth in GB/s, the ``ways`` of ``BANDWIDTH_LABELS`` (all three by default), best of
    ``trials``; measured in a subprocess so that the caller never imports torch."""
    unknown = set(ways) - set(BANDWIDTH_LABELS)
    if unknown or not ways:
        raise ValueError(f"bandwidth ways {sorted(unknown) or 'none'}: not among {list(BANDWIDTH_LABELS)}")
    wait_for_quiet(quiet_wait)
    command = [sys.executable, "-m", "harness.bandwidth", str(threads), str(trials), ",".join(ways)]
    done = subprocess.run(command, env=quiet_env(), capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def limit_tokens_per_s(bandwidth_gb_s: float, bytes_per_token: float | None) -> float | None:
    """The memory-bound ceiling: one full read of the bytes a token needs per token."""
    return bandwidth_gb_s * 1e9 / bytes_per_token if bytes_per_token else None


def main(threads: int, trials: int, ways: list[str]) -> None:
    import torch

    torch.set_num_threads(threads)

    def best(fn, *tensors) -> float:
        """GB/s of the fastest of ``trials`` calls of fn(*tensors), counting the tensors' bytes once."""
        fn(*tensors)  # warm-up (page faults, thread pool)
        times = [timed(lambda: fn(*tensors))[0] for _ in range(trials)]
        return sum(t.nbytes for t in tensors) / min(times) / 1e9

    gib, k = 1 << 30, 16384
    result = {}
    if "sum" in ways:
        result["sum"] = best(torch.sum, torch.ones(gib // 4, dtype=torch.float32))
    if "gemv_x_at_w" in ways or "gemv_linear" in ways:
        weight = torch.randn(k, gib // 4 // k, dtype=torch.float32)  # [K, N], row-major
        x = torch.randn(1, k, dtype=torch.float32)
        if "gemv_x_at_w" in ways:
            result["gemv_x_at_w"] = best(torch.matmul, x, weight)  # x @ W: reads W [K, N] row by row
        if "gemv_linear" in ways:
            result["gemv_linear"] = best(torch.nn.functional.linear, x, weight)  # x @ W.T: W seen as [N, K]
    print(json.dumps(result))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",") if len(sys.argv) > 3 else list(BANDWIDTH_LABELS))
