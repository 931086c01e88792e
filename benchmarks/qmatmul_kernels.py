"""The quantized decode kernels, before and after a change, side by side in one run.

Two source trees (``--baseline-src``: e.g. a worktree of main; ``--src``: this one) run the same jobs
in their own worker processes, alternating (base, new, base, new...), medians over ``--reps``:

* kernel: ``quantized_linear`` on the embedded model's own weights, one 576x1536 (gate, Q4_1), one
  1536x576 (down, Q4_1) and the 49152x576 output layer (Q8_0), at M = 1 and 8 rows, 1 and 2 threads
  (the microseconds per call, median of ~0.3 s of calls);
* sweep: one decode step's matrices (``--model``: a GGUF path, default the embedded model), every
  matrix once in file order so the weights stream from memory as in a step, the raw op at 1 thread:
  milliseconds per sweep (thread CPU time, so time spent descheduled on a busy machine is left out)
  for the int8-activation layers and the float-activation logits layer, M = 1 and 8, min of 5 sweeps;
* decode: the embedded model's tokens/s at batch 1 and 8 (``--new-tokens`` each), ``--threads``;
* layouts (one tree, no baseline needed): the raw op on the rows layout (the per-row kernels) vs the
  tiled layout (layers/qtiles.cpp) of the same weights, same library, M = 1, 8 and 512, 1 thread,
  alternating calls, medians: microseconds and the tiled / rows time ratio.
* isa (one tree; a CPU with AVX-512 VNNI): the same ops on their AVX2 and AVX-512 kernels
  (``ops.set_avx512``, the same results), alternating calls, medians: the int8-activation product
  on bart-base-size int8 matrices (3072x768, 768x3072, the 50265x768 head) at M = 1, 8, 32, 256, and
  the exact prompt-row product on the embedded model's Q4_1 gate at M = 64 and 512; 1 and 2 threads,
  multiply-adds per second.

    python benchmarks/qmatmul_kernels.py --baseline-src /path/to/main/src [--reps 3] [--threads 1]
        [--jobs kernel,sweep,decode] [--model path/to/model.gguf]
    python benchmarks/qmatmul_kernels.py --jobs layouts
    python benchmarks/qmatmul_kernels.py --jobs isa
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MATRICES = {"576x1536 gate Q4_1": "layers.0.gate.weight", "1536x576 down Q4_1": "layers.0.down.weight",
            "49152x576 output Q8_0": "lm_head.weight", "49152x576 Q8_0 int8 activations": "lm_head.weight"}
PROMPT = "The history of the printing press begins"


def _ops():
    """(qmatmul, exact_qmatmul, set_avx512) of the tree under test: layers/ops.py, or an older tree's
    layers/kernels.py (``--baseline-src``)."""
    try:
        from fastdecode.layers import ops

        return ops.qmatmul, ops.exact_qmatmul, ops.set_avx512
    except ImportError:
        from fastdecode.layers import kernels

        return kernels.qmatmul_op(), kernels.exact_qmatmul_op(), kernels.set_avx512


def _forward_product(x, weight):
    """quantized_linear(x, weight) under a forward's thread rules (generated rows), in either tree."""
    import torch

    from fastdecode.layers.quantized import quantized_linear

    try:
        from fastdecode.layers.products import Products
        from fastdecode.layers.threads import on_one_thread
    except ImportError:  # an older tree: the thread budget and row roles were context variables
        from fastdecode.layers.threads import one_thread_except_big_ops

        return one_thread_except_big_ops(lambda: quantized_linear(x, weight, None))
    try:
        from fastdecode.layers.products import KernelChoice
    except ImportError:  # an older tree: products carried no kernel choice (module switches chose)
        products = Products.generated(torch.get_num_threads())
    else:
        products = Products.generated(torch.get_num_threads(), kernels=KernelChoice())
    return on_one_thread(lambda: quantized_linear(x, weight, None, products))


def kernel_job() -> dict[str, float]:
    import torch

    import fastdecode

    gen = fastdecode.load()
    results = {}
    for label, name in MATRICES.items():
        weight = gen.checkpoint.weights[name].t()  # [out, in]
        if "int8 activations" in label:  # the output matrix as every other matrix runs (this tree only)
            if not hasattr(weight, "activation_bits"):
                continue
            weight = dataclasses.replace(weight, activation_bits=8)
        for rows in (1, 8):
            x = torch.randn(rows, weight.shape[1])
            for threads in (1, 2):
                torch.set_num_threads(threads)
                call = _forward_product(x, weight)  # a forward's rules
                call()
                times, started = [], time.perf_counter()
                while time.perf_counter() - started < 0.3 or len(times) < 5:
                    t0 = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t0)
                results[f"{label} M={rows} t={threads}"] = statistics.median(times) * 1e6
    return results


def sweep_job(model: str | None) -> dict[str, float]:
    import torch

    import fastdecode

    torch.set_num_threads(1)
    op, gen = _ops()[0], fastdecode.load(model)
    weights = [w.t() if w.transposed else w for name, w in gen.checkpoint.weights.items()
               if hasattr(w, "codes") and not name.startswith("embed")]  # [out, in] each; lookups excluded
    results = {}
    for rows in (1, 8):
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        sweeps = []
        for _ in range(5):
            spent = {8: 0.0, 32: 0.0}  # by activation bits
            for w in weights:
                started = time.thread_time()
                op(inputs[w.shape[1]], w.codes, w.scale, w.mins, w.bits, w.group, 1 << 40, w.activation_bits,
                   *((w.outputs,) if getattr(w, "is_tiled", False) else ()))
                spent[w.activation_bits] += time.thread_time() - started
            sweeps.append(spent)
        for bits, label in ((8, "layers"), (32, "logits")):
            gigabytes = sum(w.nbytes for w in weights if w.activation_bits == bits) / 1e9
            best = min(s[bits] for s in sweeps)
            results[f"sweep {label} {gigabytes * 1e3:.0f} MB M={rows} ms"] = best * 1e3
    return results


LAYOUT_MATRICES = {"576x576 q Q4_1": "layers.0.q.weight", "1536x576 gate Q4_1": "layers.0.gate.weight",
                   "576x1536 down Q4_1": "layers.0.down.weight", "49152x576 output Q8_0": "lm_head.weight"}


def layouts_job() -> None:
    """Prints one line per (matrix, activations, M): rows-layout and tiled-layout microseconds, ratio."""
    import torch

    import fastdecode
    from fastdecode.layers.quantized import rows_layout, tiled

    torch.set_num_threads(1)
    op, gen = _ops()[0], fastdecode.load()
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; 1 thread; medians of alternating calls")
    print("| matrix | activations | M | rows layout us | tiled us | rows / tiled |")
    print("|---|---|---|---|---|---|")
    for label, name in LAYOUT_MATRICES.items():
        weight = tiled(gen.checkpoint.weights[name].t())  # [out, in] (the LM head is kept in rows layout at load)
        codes, scale, mins = (None if t is None else t.contiguous() for t in rows_layout(weight))
        for bits in (8, 32) if "output" in label else (8,):
            for M in (1, 8) if "output" in label else (1, 8, 512):
                x = torch.randn(M, weight.inputs)
                calls = {"rows": lambda: op(x, codes, scale, mins, weight.bits, 32, 1, bits),
                         "tiled": lambda: op(x, weight.codes, weight.scale, weight.mins, weight.bits, 32, 1, bits,
                                             weight.outputs)}
                times: dict[str, list[float]] = {"rows": [], "tiled": []}
                for _ in range(max(5, min(60, int(3e8 / (M * weight.inputs * weight.outputs))))):
                    for side, call in calls.items():
                        started = time.perf_counter()
                        call()
                        times[side].append(time.perf_counter() - started)
                rows, tiles = (statistics.median(times[side]) * 1e6 for side in ("rows", "tiled"))
                print(f"| {label} | {'int8' if bits == 8 else 'float32'} | {M} | {rows:.0f} | {tiles:.0f} | {rows / tiles:.2f} |",
                      flush=True)


def isa_job() -> None:
    """Prints one line per (product, M, threads): AVX2 and AVX-512 GMAC/s (alternating calls) and the ratio."""
    import torch

    import fastdecode
    from fastdecode.layers.quantized import quantize_matrix

    qmatmul, exact, set_avx512 = _ops()
    if not set_avx512(True):
        print("this CPU has no AVX-512 VNNI (or the extension is not built): nothing to compare")
        return
    generator = torch.Generator().manual_seed(0)
    int8 = {f"{n}x{k} int8": quantize_matrix(0.05 * torch.randn(n, k, generator=generator), "int8")
            for n, k in ((3072, 768), (768, 3072), (50265, 768))}  # [out, in], tiled
    gate = fastdecode.load().checkpoint.weights["layers.0.gate.weight"].t()  # [out, in] Q4_1
    cases = [(label, w, M, lambda x, w, t: qmatmul(x, w.codes, w.scale, w.mins, w.bits, 32, t, 8, w.outputs))
             for label, w in int8.items() for M in (1, 8, 32, 256)]
    cases += [("1536x576 Q4_1 gate, exact prompt rows", gate, M,
               lambda x, w, t: exact(x, w.codes, w.scale, w.mins, w.bits, w.group, t, w.outputs)) for M in (64, 512)]
    print(f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores; medians of alternating calls")
    print("| product | M | threads | AVX2 GMAC/s | AVX-512 GMAC/s | AVX-512 / AVX2 |")
    print("|---|---|---|---|---|---|")
    for label, weight, M, call in cases:
        x = torch.randn(M, weight.inputs, generator=generator)
        work = M * weight.inputs * weight.outputs
        for threads in (1, 2):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(max(5, min(40, int(4e9 / work)))):
                for wide in (False, True):
                    set_avx512(wide)
                    started = time.perf_counter()
                    call(x, weight, threads)
                    times[wide].append(time.perf_counter() - started)
            narrow, wide = (work / statistics.median(times[side]) / 1e9 for side in (False, True))
            print(f"| {label} | {M} | {threads} | {narrow:.0f} | {wide:.0f} | {wide / narrow:.2f} |", flush=True)
    set_avx512(True)


def decode_job(threads: int, new_tokens: int) -> dict[str, float]:
    import torch

    import fastdecode

    torch.set_num_threads(threads)
    gen = fastdecode.load()
    ids = gen.encode_prompt(PROMPT)
    results = {}
    for batch in (1, 8):
        gen.generate_ids([ids] * batch, max_new_tokens=2, eos_token_id=[])  # warm
        started = time.perf_counter()
        gen.generate_ids([ids] * batch, max_new_tokens=new_tokens, eos_token_id=[])
        results[f"decode batch {batch} tok/s"] = batch * new_tokens / (time.perf_counter() - started)
    return results


def run_worker(src: str, job: str, args) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    command = [sys.executable, __file__, "--worker", job, "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens)] + (["--model", args.model] if args.model else [])
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline-src", required=False, help="src/ folder of the baseline tree")
    parser.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="threads of the decode job")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--jobs", default="kernel,decode")
    parser.add_argument("--model", default=None, help="GGUF of the sweep job (default: the embedded model)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        jobs = {"kernel": kernel_job, "sweep": lambda: sweep_job(args.model),
                "decode": lambda: decode_job(args.threads, args.new_tokens)}
        print(json.dumps(jobs[args.worker]()))
        return
    if args.jobs in ("layouts", "isa"):
        layouts_job() if args.jobs == "layouts" else isa_job()
        return
    if not args.baseline_src:
        parser.error("--baseline-src is required (except for --jobs layouts and isa)")
    sides = {"base": args.baseline_src, "new": args.src}
    samples: dict[str, dict[str, list[float]]] = {side: {} for side in sides}
    load_before = os.getloadavg()[0]
    for rep in range(args.reps):
        for job in args.jobs.split(","):
            for side, src in sides.items():
                for key, value in run_worker(src, job, args).items():
                    samples[side].setdefault(key, []).append(value)
                print(f"rep {rep + 1}/{args.reps} {job} {side} done", file=sys.stderr, flush=True)
    print(f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} cores; "
          f"medians of {args.reps} alternating runs (min-max)")
    print("| measure | base | new | new / base |")
    print("|---|---|---|---|")
    for key in samples["new"]:
        new = statistics.median(samples["new"][key])
        unit = "" if "tok/s" in key or key.endswith(" ms") else " us"
        spread = "-".join(f"{v:.1f}" for v in (min(samples["new"][key]), max(samples["new"][key])))
        if key not in samples["base"]:
            print(f"| {key} | - | {new:.1f}{unit} ({spread}) | - |")
            continue
        base = statistics.median(samples["base"][key])
        print(f"| {key} | {base:.1f}{unit} | {new:.1f}{unit} ({spread}) | {new / base:.2f} |")


if __name__ == "__main__":
    main()
