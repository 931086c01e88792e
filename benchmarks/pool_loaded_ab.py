#!/usr/bin/env python
"""The kernel thread pool alone (layers/parallel.h) on two cores beside busy processes, two source trees A/B.

    python benchmarks/pool_loaded_ab.py --trees /work/main/src,src [--load 0,1,2,4] [--rounds 4] [--seconds 0.25]
        [--cpus 0,1] [--copies 4]

Each tree's parallel.h is compiled into a program of its own (benchmarks/pool_loaded_ab.cpp, with the C++ compiler
and torch's headers): a batch-1 decode step's shape of parallel_chunks calls (SmolLM2-135M's products at half a
byte per weight, a few microseconds of the caller's own work between them; ``--copies`` copies of the weights read in
turn, 270 MB by default, so that they stream from memory, past any L3 cache), no Python, no model, steps per second
on 1 and 2 threads (1, 2, 2, 1 in each round). Everything runs on ``--cpus`` (default: the first two this process
may use): on a machine with more cores, two of them make the shared 2-core machine, the busy processes included,
and the figures repeat from run to run where the whole engine's beside other users' load do not. For each
``--load`` level the script starts that many busy processes (``while True: pass``), each in a session of its own
(where the kernel's autogroup scheduling is on, as another user's program); the trees' programs alternate, one
process per round. Reported per level and thread count: each tree's median steps/s, B / A, and each tree's 2
threads against its 1 thread (medians of the rounds' ratios: drift hits both alike).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_count, median, stop_process, table

FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]  # layers/kernels.py's CFLAGS


def torch_folder() -> Path:
    """torch's package folder (headers and libraries), found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch is not installed: its headers are needed for parallel.h")
    return Path(spec.submodule_search_locations[0])


def compile_program(tree: str, binary: str) -> None:
    torch = torch_folder()
    command = ["c++", *FLAGS, f"-I{Path(tree) / 'fastdecode' / 'layers'}", f"-I{torch / 'include'}",
               str(Path(__file__).with_name("pool_loaded_ab.cpp")), "-o", binary, f"-L{torch / 'lib'}", "-ltorch_cpu",
               "-lc10", f"-Wl,-rpath,{torch / 'lib'}", "-lpthread"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")


def run_round(binary: str, seconds: float, copies: int) -> dict[int, list[float]]:
    """One process of the program, one round -> steps/s per thread count (two measurements each)."""
    done = subprocess.run([binary, str(seconds), "1", str(copies)], capture_output=True, text=True, check=True)
    speeds: dict[int, list[float]] = {1: [], 2: []}
    for line in done.stdout.split("\n"):
        if line.strip():
            threads, steps = line.split()
            speeds[int(threads)].append(float(steps))
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="A,B: two source trees' src folders")
    parser.add_argument("--load", default="0,1,2,4", help="busy processes, per level")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per level (one process per tree and round)")
    parser.add_argument("--seconds", type=float, default=0.25, help="per measurement (4 in a round)")
    parser.add_argument("--copies", type=int, default=4, help="copies of the weights (67 MB each), read in turn")
    parser.add_argument("--cpus", default="", help="the CPUs everything runs on (default: the first two)")
    args = parser.parse_args()
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(",")]
    if len(trees) != 2:
        parser.error("--trees takes two src folders")
    cpus = {int(c) for c in args.cpus.split(",")} if args.cpus else set(sorted(os.sched_getaffinity(0))[:2])
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        binaries = [f"{folder}/{name}" for name in "ab"]
        for tree, binary in zip(trees, binaries):
            compile_program(tree, binary)
        os.sched_setaffinity(0, cpus)  # this process and (inherited) every process it starts from now on
        for load in (int(n) for n in args.load.split(",")):
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                    for _ in range(load)]
            runs: list[list[dict[int, list[float]]]] = [[], []]
            try:
                time.sleep(0.5)
                for round_ in range(args.rounds):
                    for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                        runs[index].append(run_round(binaries[index], args.seconds, args.copies))
            finally:
                for process in busy:
                    stop_process(process, grace=5)
            for threads in (1, 2):
                speed = [[median(run[threads]) for run in tree_runs] for tree_runs in runs]
                gain = [[median(run[2]) / median(run[1]) for run in tree_runs] for tree_runs in runs]
                rows.append([load, threads, f"{median(speed[0]):.1f}", f"{median(speed[1]):.1f}",
                             f"{median(b / a for a, b in zip(*speed)):.3f}",
                             *(f"{median(g):.3f}" if threads == 2 else "" for g in gain)])
                print("  " + " | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
    print(f"\n{cpu_count()} CPUs here, everything on CPUs {sorted(cpus)}; A = {trees[0]}, B = {trees[1]}; {args.rounds} "
          f"rounds of {args.seconds} s x 4 per tree and level; load average {os.getloadavg()[0]:.2f} at the end\n")
    print(table(["busy processes", "threads", "A steps/s", "B steps/s", "B / A", "A: 2 threads / 1", "B: 2 threads / 1"],
                rows))


if __name__ == "__main__":
    main()
