#!/usr/bin/env python
"""The float kernel for several generated rows (layers/fmatmul_avx512.cpp) under two source trees, A/B.

    python benchmarks/float_kernel_ab.py --trees /work/main/src,src [--rows 16] [--reps 7] [--copies 30]
    python benchmarks/float_kernel_ab.py --trees /work/main/src,src --model bart --rows 32 --copies 6 --pieces
    python benchmarks/float_kernel_ab.py --trees OLD/src,src --model whisper --weights float16 --rows 1-8 --pieces
    python benchmarks/float_kernel_ab.py --trees OLD/src,src --model whisper --weights float16 --rows 5 \\
        --processes --threads 2 --copies 80

Both trees' AVX-512 float kernel built into ONE process (benchmarks/float_kernel_ab.cpp, with the C++ compiler),
calls alternating, one thread, timed by the thread's CPU time (robust to other processes on a shared machine, not
to their use of the memory bus): on the float32 shapes of the embedded SmolLM2-135M's decode step (the products
as the model holds them at load: Q/K/V fused, gate/up fused, the tied logits layer), ``--copies`` copies of each
block matrix (its layers: the weights stream from memory as in a step) and one logits layer. G multiply-adds/s,
median (best) of ``--reps``, ms per product (medians), and whether both trees give the same bits. ``--model bart``:
bart-base's decoder products instead (a beam-4 step of 8 sources has 32 rows); ``--model whisper``: Whisper base's
(a beam-5 step has 5 rows). ``--weights float16``: the matrices held in float16 (each value rounded to its
float16), as Whisper's decoder products are (models/whisper.py's hold_in_half), widened by the kernel as it loads
them. ``--rows``: one count, a list (``1,5,8``) or a range (``1-8``), a table each. ``--pieces``: each call covers
one column chunk of the width fmatmul.cpp hands to a thread (an eighth of N, 48 to 1536 columns), not the whole
matrix at once. (One row: the kernel itself; float_matmul runs one row of K > 64 on another path.)

``--processes``: instead, each tree's built extension (``make install`` in it first) through ``ops.float_matmul``
on ``--threads`` threads (its chunks and thread pool, as a model calls it), one process per tree per repetition,
the trees alternating (A, B, A, B...); ms per product by the wall clock, median over the processes of each
process's median of 5 sweeps over the copies (each copy once per sweep, after a warm-up sweep). Needs an AVX-512 CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import table

SHAPES = {  # (label, K, N, one per layer)
    "smollm": [("Q/K/V", 576, 960, True), ("O", 576, 576, True), ("gate/up", 576, 3072, True),
               ("down", 1536, 576, True), ("logits", 576, 49152, False)],
    "bart": [("Q/K/V", 768, 2304, True), ("O, cross Q, cross O", 768, 768, True), ("fc1", 768, 3072, True),
             ("fc2", 3072, 768, True), ("logits", 768, 50265, False)],
    "whisper": [("Q, K, V, O, cross Q, cross O", 512, 512, True), ("up", 512, 2048, True),
                ("down", 2048, 512, True), ("logits", 512, 51865, False)],
}
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]  # layers/kernels.py's CFLAGS
CHILD_SWEEPS = 5


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")


def _row_counts(text: str) -> list[int]:
    """"16", "1,5,8" or "1-8" -> the row counts."""
    counts: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        counts.extend(range(int(low), int(high or low) + 1))
    return counts


def _child(K: int, N: int, M: int, copies: int, half: bool, threads: int) -> None:
    """One process's timing through the fastdecode on its PYTHONPATH: prints "ms digest"."""
    import torch

    from fastdecode.layers import ops

    generator = torch.Generator().manual_seed(2)
    weights = [torch.rand(K, N, generator=generator) - 0.5 for _ in range(copies)]  # [K, N] each
    if half:
        weights = [w.half() for w in weights]
    x = torch.rand(M, K, generator=torch.Generator().manual_seed(1)) - 0.5  # [M, K]
    y = None
    for w in weights:  # warm-up sweep
        y = ops.float_matmul(x, w, None, threads)
    sweeps = []
    for _ in range(CHILD_SWEEPS):
        start = time.perf_counter()
        for w in weights:
            y = ops.float_matmul(x, w, None, threads)
        sweeps.append((time.perf_counter() - start) / copies * 1e3)
    print(f"{statistics.median(sweeps):.5f} {hashlib.sha256(y.numpy().tobytes()).hexdigest()[:16]}")


def _processes(args: argparse.Namespace, trees: list[str], counts: list[int]) -> None:
    """--processes: each tree's ops.float_matmul in alternating processes, ms per product."""
    for M in counts:
        rows = []
        for label, K, N, per_layer in SHAPES[args.model]:
            copies = args.copies if per_layer else max(1, args.copies // 20)
            ms: list[list[float]] = [[], []]
            digests: list[set[str]] = [set(), set()]
            for _ in range(args.reps):
                for index, tree in enumerate(trees):
                    env = {**os.environ, "PYTHONPATH": tree}
                    done = subprocess.run([sys.executable, __file__, "--child", str(K), str(N), str(M), str(copies),
                                           str(int(args.weights == "float16")), str(args.threads)],
                                          env=env, check=True, capture_output=True, text=True)
                    value, digest = done.stdout.split()
                    ms[index].append(float(value))
                    digests[index].add(digest)
            a, b = statistics.median(ms[0]), statistics.median(ms[1])
            rows.append([f"{label} {K} x {N} (x{copies})", f"{a:.4f} ({min(ms[0]):.4f}-{max(ms[0]):.4f})",
                         f"{b:.4f} ({min(ms[1]):.4f}-{max(ms[1]):.4f})", f"{b / a:.2f}x",
                         "yes" if digests[0] == digests[1] and len(digests[0]) == 1 else "NO"])
        print(f"\n{args.model}, {M} rows, {args.weights} weights, {args.threads} threads, ops.float_matmul, processes "
              f"alternating: ms per product, median (min-max) of {args.reps}; load average {os.getloadavg()[0]:.2f}\n")
        print(table(["product", trees[0], trees[1], "B / A", "same bits"], rows))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        K, N, M, copies, half, threads = (int(value) for value in sys.argv[2:8])
        _child(K, N, M, copies, bool(half), threads)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", required=True, help="A,B: two source trees' src folders")
    parser.add_argument("--rows", default="16", help="row counts: 16, 1,5,8 or 1-8")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--copies", type=int, default=30, help="copies of each block matrix (the layers)")
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm", help="whose decode products")
    parser.add_argument("--weights", choices=["float32", "float16"], default="float32",
                        help="how the matrices are held (float16: widened by the kernel as it loads them)")
    parser.add_argument("--pieces", action="store_true", help="one call per column chunk, as float_matmul's")
    parser.add_argument("--processes", action="store_true",
                        help="each tree's built extension (ops.float_matmul) in alternating processes instead")
    parser.add_argument("--threads", type=int, default=2, help="--processes: float_matmul's threads")
    args = parser.parse_args()
    trees = args.trees.split(",")
    if len(trees) != 2:
        parser.error("--trees takes two src folders")
    if args.pieces and args.processes:
        parser.error("--pieces is the one-process harness's; --processes runs float_matmul's own chunks")
    counts = _row_counts(args.rows)
    if args.processes:
        _processes(args, trees, counts)
        return
    with tempfile.TemporaryDirectory() as folder:
        objects = []
        for name, tree in zip("ab", trees):
            layers = Path(tree) / "fastdecode" / "layers"
            objects.append(f"{folder}/{name}.o")
            _compile(["c++", *FLAGS, f"-I{layers}", f"-Davx512=avx512_{name}", "-c",
                      str(layers / "fmatmul_avx512.cpp"), "-o", objects[-1]])
        binary = f"{folder}/float_kernel_ab"
        _compile(["c++", *FLAGS, str(Path(__file__).with_name("float_kernel_ab.cpp")), *objects, "-o", binary])
        for M in counts:
            rows = []
            for label, K, N, per_layer in SHAPES[args.model]:
                copies = args.copies if per_layer else 1
                chunk = min(max((N // 8 + 47) // 48 * 48, 48), 1536) if args.pieces else N  # fmatmul.cpp's chunk
                done = subprocess.run([binary, str(K), str(N), str(M), str(copies), str(args.reps), str(chunk),
                                       str(int(args.weights == "float16"))], check=True, capture_output=True, text=True)
                a_best, a_median, b_best, b_median, equal = done.stdout.split()
                ms_a, ms_b = (M * K * N / float(value) / 1e6 for value in (a_median, b_median))  # per product
                rows.append([f"{label} {K} x {N} (x{copies})", f"{a_median} ({a_best})", f"{b_median} ({b_best})",
                             f"{float(b_median) / float(a_median):.2f}x", f"{ms_a:.4f} / {ms_b:.4f}",
                             "yes" if equal == "1" else "NO"])
            pieces = "one call per column chunk" if args.pieces else "one call per matrix"
            print(f"\n{args.model}, {M} rows, {args.weights} weights, 1 thread, {pieces}, calls alternating: G "
                  f"multiply-adds/s, median (best) of {args.reps}; load average {os.getloadavg()[0]:.2f}\n")
            print(table(["product", trees[0], trees[1], "B / A", "ms per product A / B", "same bits"], rows))


if __name__ == "__main__":
    main()
