#!/usr/bin/env python
"""The float kernel for several generated rows (layers/fmatmul_avx512.cpp) under two source trees, A/B.

    python benchmarks/float_kernel_ab.py --trees /work/main/src,src [--rows 16] [--reps 7] [--copies 30]
    python benchmarks/float_kernel_ab.py --trees /work/main/src,src --model bart --rows 32 --copies 6 --pieces

Both trees' AVX-512 float kernel built into ONE process (benchmarks/float_kernel_ab.cpp, with the C++ compiler),
calls alternating, one thread, timed by the thread's CPU time (robust to other processes on a shared machine, not
to their use of the memory bus): on the float32 shapes of the embedded SmolLM2-135M's decode step (the products
as the model holds them at load: Q/K/V fused, gate/up fused, the tied logits layer), ``--copies`` copies of each
block matrix (its layers: the weights stream from memory as in a step) and one logits layer. G multiply-adds/s,
median (best) of ``--reps``, and whether both trees give the same bits. ``--model bart``: bart-base's decoder
products instead (a beam-4 step of 8 sources has 32 rows). ``--pieces``: each call covers one column chunk of the
width fmatmul.cpp hands to a thread (an eighth of N, 48 to 1536 columns), not the whole matrix at once. Needs an
AVX-512 CPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

from harness import table

SHAPES = {  # (label, K, N, one per layer)
    "smollm": [("Q/K/V", 576, 960, True), ("O", 576, 576, True), ("gate/up", 576, 3072, True),
               ("down", 1536, 576, True), ("logits", 576, 49152, False)],
    "bart": [("Q/K/V", 768, 2304, True), ("O, cross Q, cross O", 768, 768, True), ("fc1", 768, 3072, True),
             ("fc2", 3072, 768, True), ("logits", 768, 50265, False)],
}
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
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm", help="whose decode products")
    parser.add_argument("--pieces", action="store_true", help="one call per column chunk, as float_matmul's")
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
        for label, K, N, per_layer in SHAPES[args.model]:
            copies = args.copies if per_layer else 1
            chunk = min(max((N // 8 + 47) // 48 * 48, 48), 1536) if args.pieces else N  # fmatmul.cpp's chunk
            done = subprocess.run([binary, str(K), str(N), str(args.rows), str(copies), str(args.reps), str(chunk)],
                                  check=True, capture_output=True, text=True)
            a_best, a_median, b_best, b_median, equal = done.stdout.split()
            rows.append([f"{label} {K} x {N} (x{copies})", f"{a_median} ({a_best})", f"{b_median} ({b_best})",
                         f"{float(b_median) / float(a_median):.2f}x", "yes" if equal == "1" else "NO"])
    pieces = "one call per column chunk" if args.pieces else "one call per matrix"
    print(f"\n{args.model}, {args.rows} rows, 1 thread, {pieces}, calls alternating: G multiply-adds/s, median (best) of {args.reps}; "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print(table(["product", trees[0], trees[1], "B / A", "same bits"], rows))


if __name__ == "__main__":
    main()
