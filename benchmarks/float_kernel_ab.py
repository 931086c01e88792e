#!/usr/bin/env python
"""The float kernel for several generated rows (layers/fmatmul_avx512.cpp) under two source trees, A/B.

    python benchmarks/float_kernel_ab.py --trees /work/main/src,src [--rows 16] [--reps 7] [--copies 30]

Both trees' AVX-512 float kernel built into ONE process (benchmarks/float_kernel_ab.cpp, with the C++ compiler),
calls alternating, one thread, timed by the thread's CPU time (robust to other processes on a shared machine, not
to their use of the memory bus): on the float32 shapes of the embedded SmolLM2-135M's decode step (the products
as the model holds them at load: Q/K/V fused, gate/up fused, the tied logits layer), ``--copies`` copies of each
block matrix (its layers: the weights stream from memory as in a step) and one logits layer. G multiply-adds/s,
median (best) of ``--reps``, and whether both trees give the same bits. Needs an AVX-512 CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from harness import table

SHAPES = [("Q/K/V", 576, 960, True), ("O", 576, 576, True), ("gate/up", 576, 3072, True),
          ("down", 1536, 576, True), ("logits", 576, 49152, False)]  # (label, K, N, one per layer)
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]  # layers/kernels.py's CFLAGS


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", required=True, help="A,B: two source trees' src folders")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--copies", type=int, default=30, help="copies of each block matrix (the layers)")
    args = parser.parse_args()
    trees = args.trees.split(",")
    if len(trees) != 2:
        parser.error("--trees takes two src folders")
    with tempfile.TemporaryDirectory() as folder:
        objects = []
        for name, tree in zip("ab", trees):
            layers = Path(tree) / "fastdecode" / "layers"
            objects.append(f"{folder}/{name}.o")
            _compile(["c++", *FLAGS, f"-I{layers}", f"-Davx512=avx512_{name}", "-c",
                      str(layers / "fmatmul_avx512.cpp"), "-o", objects[-1]])
        binary = f"{folder}/float_kernel_ab"
        _compile(["c++", *FLAGS, str(Path(__file__).with_name("float_kernel_ab.cpp")), *objects, "-o", binary])
        rows = []
        for label, K, N, per_layer in SHAPES:
            copies = args.copies if per_layer else 1
            done = subprocess.run([binary, str(K), str(N), str(args.rows), str(copies), str(args.reps)],
                                  check=True, capture_output=True, text=True)
            a_best, a_median, b_best, b_median, equal = done.stdout.split()
            rows.append([f"{label} {K} x {N} (x{copies})", f"{a_median} ({a_best})", f"{b_median} ({b_best})",
                         f"{float(b_median) / float(a_median):.2f}x", "yes" if equal == "1" else "NO"])
    print(f"\n{args.rows} rows, 1 thread, calls alternating: G multiply-adds/s, median (best) of {args.reps}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print(table(["product", trees[0], trees[1], "B / A", "same bits"], rows))


if __name__ == "__main__":
    main()
