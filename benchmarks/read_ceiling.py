#!/usr/bin/env python
"""How fast this machine's memory can be read: hand-written readers against torch.sum (harness.bandwidth's figure).

    python benchmarks/read_ceiling.py [--threads 1,2] [--rounds 8] [--buffers 1024,weights] [--variants ...]

benchmarks/read_ceiling.cpp, compiled here with the C++ compiler (-march=native: AVX-512 loads where the CPU has
them, else AVX2), reads a buffer whole on THREADS pinned threads, each variant once per round: plain loads, software
prefetch (prefetcht0 / prefetchnta) at several distances, several far-apart streams per thread (as a batch-1
product reads several weight rows at once), the threads taking interleaved chunks instead of one half each,
non-temporal loads, and a kernel's work between the loads (``w6``: about what a 4-bit batch-1 product computes per
byte on Zen 5, ``w12`` a 6-bit one: does the bus still fill when the cores also compute?). A buffer is a size in MiB of anonymous memory (``1024h``: in transparent huge pages), or
``weights``: the largest repacked weights file
under ~/.cache/fastdecode/weights (mapped read-only, as the engine maps it). Each round also measures torch.sum over
1 GiB (harness.bandwidth, a subprocess) at each thread count; the variants rotate their order from round to round.

Reported per buffer, thread count and variant: the best and the median GB/s of the rounds, and the best against
torch.sum's best. On a shared machine the best is the ceiling's estimate (a round another process preempts is
only slower); the median says how often a variant gets there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

VARIANTS = ("plain,nt,t0256,t0512,t01024,t02048,t04096,nta512,nta1024,nta2048,nta4096,s2,s4,s8,s4:t01024,s8:t0512,"
            "c16,c64,c256,c64:s4,w6,w6:nta4096,w6:s2:nta4096,w12:nta4096")


def compile_program(binary: str) -> None:
    command = ["c++", "-O3", "-march=native", "-std=c++17", "-pthread",
               str(Path(__file__).with_name("read_ceiling.cpp")), "-o", binary]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")


def weights_file() -> Path:
    files = sorted(Path.home().glob(".cache/fastdecode/weights/*.fdw"), key=lambda p: p.stat().st_size)
    if not files:
        raise SystemExit("no repacked weights under ~/.cache/fastdecode/weights: load a model with fastdecode first")
    return files[-1]


def run_round(binary: str, buffer: str, threads: int, variants: list[str]) -> dict[str, float]:
    done = subprocess.run([binary, buffer, str(threads), "1", *variants], capture_output=True, text=True, check=True)
    return {name: float(speed) for name, speed in (line.split() for line in done.stdout.splitlines() if line.strip())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts (pinned to the first CPUs this process may use)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds (each variant once per round)")
    parser.add_argument("--buffers", default="1024,weights", help="MiB of anonymous memory ('1024h': huge pages), or 'weights'")
    parser.add_argument("--variants", default=VARIANTS, help="read_ceiling.cpp's variants, comma-separated")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    variants = args.variants.split(",")
    buffers = {name: str(weights_file()) if name == "weights" else name for name in args.buffers.split(",")}
    speeds: dict[tuple[str, int, str], list[float]] = {}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as folder:
        binary = f"{folder}/read_ceiling"
        compile_program(binary)
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
            for threads in thread_counts:
                for name, buffer in buffers.items():
                    for variant, speed in run_round(binary, buffer, threads, order).items():
                        speeds.setdefault((name, threads, variant), []).append(speed)
                speed = harness.measure_bandwidth(threads, 3, ways=("sum",))["sum"]
                speeds.setdefault(("1024", threads, "torch.sum"), []).append(speed)
            loads.append(os.getloadavg()[0])
            print(f"  round {round_ + 1}/{args.rounds}, load {loads[-1]:.2f}", file=sys.stderr, flush=True)
    rows = []
    for threads in thread_counts:
        reference = max(speeds[("1024", threads, "torch.sum")])
        for name in buffers:
            for variant in ["torch.sum", *variants] if name == "1024" else variants:
                values = speeds.get((name, threads, variant))
                if values:
                    rows.append([name if name != "weights" else "weights file", threads, variant,
                                 f"{max(values):.1f}", f"{harness.median(values):.1f}", f"{max(values) / reference:.3f}"])
    print(f"\n{harness.machine_line(max(thread_counts))}; {args.rounds} rounds; load average "
          f"{min(loads):.2f}-{max(loads):.2f} over the run; weights file {buffers.get('weights', '-')}\n")
    print(harness.table(["buffer (MiB)", "threads", "variant", "best GB/s", "median GB/s", "best / torch.sum best"],
                        rows))


if __name__ == "__main__":
    main()
