"""The quantized decode kernels on 1 and 2 threads, on a quiet core pair and beside a busy process.

Times the raw ``qmatmul`` op on the embedded model's own matrices (M = 1 and 8 rows), calls on 1 and 2
threads interleaved in one process (medians of ~0.3 s each), in ``--reps`` worker processes that alternate
between the source trees given (``--src``, and ``--baseline-src`` for e.g. main). ``--decode`` times
whole greedy decode steps of the embedded model instead (batch 1 and 8, generate calls on 1 and 2
threads interleaved). ``--busy`` runs a spinning Python process beside each worker (``while True: pass``,
nice 0): the second core is then taken half the time, as on a shared machine. ``--one-core`` pins each
worker to one core (``taskset -c 0``): a second thread then never has a core of its own.

    python benchmarks/kernel_threads.py [--baseline-src /work/main/src] [--busy | --one-core] [--decode] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MATRICES = {"192x576 k": "layers.0.k.weight", "576x576 q": "layers.0.q.weight",
            "1536x576 gate": "layers.0.gate.weight", "576x1536 down": "layers.0.down.weight",
            "49152x576 logits": "lm_head.weight"}


def worker() -> dict[str, float]:
    import torch

    import fastdecode
    from fastdecode.layers.quantized import for_logits

    try:
        from fastdecode.layers import ops

        op, takes_threads = ops.qmatmul, True
    except ImportError:  # an older tree (--baseline-src)
        from fastdecode.layers.kernels import qmatmul_op

        op = qmatmul_op()
        takes_threads = "threads" in str(op.default._schema)  # else the old op: grain + torch's OpenMP threads
    weights = fastdecode.load().checkpoint.weights
    results = {}
    for label, name in MATRICES.items():
        weight = weights[name].t()  # [out, in]
        weight = for_logits(weight) if "logits" in label else weight
        for rows in (1, 8):
            x = torch.randn(rows, weight.shape[1])
            samples: dict[int, list[float]] = {1: [], 2: []}
            started = time.perf_counter()
            while time.perf_counter() - started < 0.6 or len(samples[2]) < 5:
                for threads in (1, 2):
                    torch.set_num_threads(1 if takes_threads else threads)
                    argument = threads if takes_threads else 1  # grain 1: OpenMP splits evenly
                    t0 = time.perf_counter()
                    op(x, weight.codes, weight.scale, weight.mins, weight.bits, weight.group, argument,
                       weight.activation_bits)
                    samples[threads].append(time.perf_counter() - t0)
            for threads, times in samples.items():
                results[f"{label} M={rows} t={threads}"] = statistics.median(times) * 1e6
    return results


def decode_worker(rounds: int = 5, new_tokens: int = 32) -> dict[str, float]:
    """Milliseconds per greedy decode step, batch 1 and 8, on 1 and 2 threads (medians of ``rounds``)."""
    import torch

    import fastdecode

    gen = fastdecode.load()
    prompt = [504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28, 645, 28322, 45382]
    results = {}
    for batch in (1, 8):
        prompts = [prompt[i:] + prompt[:i] for i in range(batch)]
        gen.generate_ids(prompts, max_new_tokens=4, eos_token_id=[])  # warm-up
        samples: dict[int, list[float]] = {1: [], 2: []}
        for _ in range(rounds):
            for threads in (1, 2):
                torch.set_num_threads(threads)
                t0 = time.perf_counter()
                gen.generate_ids(prompts, max_new_tokens=new_tokens, eos_token_id=[])
                samples[threads].append((time.perf_counter() - t0) / new_tokens)
        for threads, times in samples.items():
            results[f"decode step B={batch} t={threads}"] = statistics.median(times) * 1e6
    return results


def run_worker(src: str, busy: bool, one_core: bool, decode: bool) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src, PYTHONWARNINGS="ignore")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    pin = ["taskset", "-c", str(min(os.sched_getaffinity(0)))] if one_core else []
    try:
        out = subprocess.run([*pin, sys.executable, __file__, "--decode-worker" if decode else "--worker"], env=env,
                             capture_output=True, text=True, check=True).stdout
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", default=None, help="src/ folder of a baseline tree")
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--busy", action="store_true", help="a spinning process beside each worker")
    parser.add_argument("--one-core", action="store_true", help="each worker pinned to one core")
    parser.add_argument("--decode", action="store_true", help="whole decode steps instead of single products")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--decode-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker or args.decode_worker:
        print(json.dumps(decode_worker() if args.decode_worker else worker()))
        return
    sides = {"new": args.src} if args.baseline_src is None else {"base": args.baseline_src, "new": args.src}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        for side, src in sides.items():
            for key, value in run_worker(src, args.busy, args.one_core, args.decode).items():
                samples[side].setdefault(key, []).append(value)
    setting = "a busy process beside" if args.busy else "pinned to one core" if args.one_core else "no added load"
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores; "
          f"{setting}; medians of {args.reps} runs, us per call")
    print("| op | " + " | ".join(f"{side} t=1 | {side} t=2 | {side} t=2/t=1" for side in sides) + " |")
    print("|---|" + "---|---|---|" * len(sides))
    for key in samples["new"]:
        if not key.endswith("t=1"):
            continue
        op = key[: -len(" t=1")]
        cells = []
        for side in sides:
            one = statistics.median(samples[side][f"{op} t=1"])
            two = statistics.median(samples[side][f"{op} t=2"])
            cells.append(f"{one:.1f} | {two:.1f} | {two / one:.2f}")
        print(f"| {op} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
