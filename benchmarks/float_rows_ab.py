#!/usr/bin/env python
"""The float kernel's in-place row limits, A/B in one process: two settings of ``KernelChoice.in_place_rows``.

    python benchmarks/float_rows_ab.py [--limits 64,32:machine] [--model smollm|bart] [--rows 32] [--threads 2]
                                       [--reps 9] [--copies 6]

Up to how many rows (9 or more) ``float_matmul`` reads the weights in place rather than from packed copies of their
column blocks (layers/float_rows_choice.py): both give the same bits (checked here), only the speed differs. A and B
(``--limits``, "spread,aliased" pairs, or "machine": the limits this machine's first load measured, from the cache
file) run the decode products of a model (float_kernel_ab.py's shapes: ``--copies`` copies of each block matrix, one
logits layer, so the weights stream from memory as in a step) at ``--rows`` rows on ``--threads`` threads of the
kernel pool, a whole step's products per call of each, alternating which goes first. Wall time (CPU time of the
calling thread on one thread); G multiply-adds/s per product, medians (min-max) of ``--reps``, and the load.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from float_kernel_ab import SHAPES  # the models' decode shapes
from harness import median, spread, table

from fastdecode.layers import float_rows_choice, ops


def parse_limits(text: str) -> tuple[int, int]:
    if text == "machine":
        return float_rows_choice.machine_in_place_rows()
    limits = float_rows_choice.valid_limits([int(value) for value in text.split(",")])
    if limits is None:
        raise SystemExit(f"--limits: two ints from 8 to 64 (spread,aliased) or 'machine', got {text!r}")
    return limits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limits", default="64,32:machine", help="A:B, each 'spread,aliased' or 'machine'")
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--copies", type=int, default=6, help="copies of each block matrix (the layers)")
    args = parser.parse_args()
    if not ops.available():
        raise SystemExit("needs the kernels (python -m fastdecode.layers.kernels)")
    settings = [parse_limits(text) for text in args.limits.split(":")]
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    generator = torch.Generator().manual_seed(0)
    products = []  # (label, K, N, copies of the [K, N] weight)
    for label, K, N, per_layer in SHAPES[args.model]:
        base = torch.rand(K, N, generator=generator) - 0.5
        products.append((label, K, N, [base.clone() for _ in range(args.copies if per_layer else 1)]))
    x = {K: torch.rand(args.rows, K, generator=generator) - 0.5 for _, K, _, _ in products}
    seconds = {(label, s): [] for label, _, _, _ in products for s in range(2)}
    same = True
    with torch.inference_mode():
        for label, K, _, copies in products:  # the same bits under both limits (and warm-up)
            outs = [ops.float_matmul(x[K], copies[0], None, args.threads, *limits) for limits in settings]
            same = same and torch.equal(*outs)
        for rep in range(args.reps):
            for s in (0, 1) if rep % 2 == 0 else (1, 0):
                for label, K, _, copies in products:
                    start = clock()
                    for weight in copies:
                        ops.float_matmul(x[K], weight, None, args.threads, *settings[s])
                    seconds[label, s].append(clock() - start)
    rows, totals = [], [[0.0] * args.reps for _ in range(2)]
    for label, K, N, copies in products:
        work = args.rows * K * N * len(copies) / 1e9
        rates = [[work / t for t in seconds[label, s]] for s in range(2)]
        for s in range(2):
            for rep, t in enumerate(seconds[label, s]):
                totals[s][rep] += t
        rows.append([f"{label} {K} x {N} (x{len(copies)})", spread(rates[0]), spread(rates[1]),
                     f"{median(rates[1]) / median(rates[0]):.2f}x"])
    rows.append(["step (ms)", spread([1e3 * t for t in totals[0]], 2), spread([1e3 * t for t in totals[1]], 2),
                 f"{median(totals[0]) / median(totals[1]):.2f}x"])
    print(f"\n{args.model}, {args.rows} rows, {args.threads} thread(s), A {settings[0]} / B {settings[1]} "
          f"(in-place rows: spread, aliased), alternating: G multiply-adds/s, median (min-max) of {args.reps}; "
          f"same bits: {same}; load average {os.getloadavg()[0]:.2f}\n")
    print(table(["product", f"A {settings[0]}", f"B {settings[1]}", "B / A"], rows))


if __name__ == "__main__":
    main()
