#!/usr/bin/env python
"""Prompt rows' exact float products (layers/exact_matmul.cpp) under two source trees, A/B (issue 29).

    python benchmarks/exact_prompt_ab.py --trees /work/wt-b1/src,/work/wt-exact/src [--reps 5] [--rows 512]
        [--jobs kernel,ops,prompt,qwen] [--qwen ~/.cache/fastdecode/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf]

Each repetition runs one fresh process per tree, the trees alternating (drift in the machine's load hits
both alike), each with ``PYTHONPATH`` set to its tree, torch on 1 thread. Timed by the thread's CPU time
(robust to other processes on a shared machine), the best of 5 calls per process, medians (min-max) over
the repetitions:

* ops: ``exact_qmatmul`` on 1 thread, ``--rows`` rows, on random tiled weights of the attention products'
  shapes: SmolLM2-135M's Q4_1 Q/K/V (576 -> 960) and O (576 -> 576), Qwen2.5-1.5B's Q4_K Q/K/V
  (1536 -> 2048) and O (1536 -> 1536): ms and GFLOP/s (2 x rows x inputs x outputs per call);
* prompt: the embedded SmolLM2-135M Q4_1 on a 512-token prompt (README text), 1 new token, 1 thread: CPU ms;
* qwen: the same 512-token prompt on the GGUF given with ``--qwen`` (best of 2 calls; slow at 1 thread);
* kernel (two trees, AVX-512 CPUs): the AVX-512 multiply of both trees' layers/exact_matmul_avx512.cpp in ONE
  process, calls alternating (benchmarks/exact_kernel_ab.cpp, built here with the C++ compiler): the steadiest
  A/B on a shared machine; decoded weights, the shapes above, best and median GFLOP/s of 4 x ``--reps`` calls,
  and whether both gave the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_line, run_in_tree, spread, table

ROOT = Path(__file__).resolve().parents[1]
# (label, GGUF type name, inputs, outputs)
SHAPES = [("SmolLM2 qkv 576->960 Q4_1", "Q4_1", 576, 960), ("SmolLM2 o 576->576 Q4_1", "Q4_1", 576, 576),
          ("Qwen qkv 1536->2048 Q4_K", "Q4_K", 1536, 2048), ("Qwen o 1536->1536 Q4_K", "Q4_K", 1536, 1536)]
PROMPT_TOKENS = 512


def _best_cpu_ms(call, count: int) -> float:
    best = float("inf")
    for _ in range(count):
        start = time.thread_time()
        call()
        best = min(best, time.thread_time() - start)
    return best * 1e3


def _prompt_ms(gen, count: int) -> float:
    ids = gen.tokenizer.encode((ROOT / "README.md").read_text() * 4)[:PROMPT_TOKENS]  # [512] token ids
    gen.generate_ids([ids[:64]], max_new_tokens=1, eos_token_id=[])  # warm-up
    return _best_cpu_ms(lambda: gen.generate_ids([ids], max_new_tokens=1, eos_token_id=[]), count)


def _compile(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)  # torch's headers warn at C++17: shown on failure
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")


def kernel_ab(trees: list[str], rows: int, reps: int) -> None:
    """Build benchmarks/exact_kernel_ab.cpp against both trees' AVX-512 exact kernel and print its table."""
    import tempfile

    from torch.utils.cpp_extension import include_paths, library_paths

    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-std=c++17", "-ffp-contract=off"]  # kernels.py's CFLAGS
    torch_flags = [f"-I{path}" for path in include_paths()]
    with tempfile.TemporaryDirectory() as folder:
        objects = []
        for name, tree in zip("ab", trees):
            layers = Path(tree) / "fastdecode" / "layers"
            objects.append(f"{folder}/{name}.o")
            _compile(["c++", *flags, *torch_flags, f"-I{layers}", f"-Davx512=avx512_{name}", "-c",
                      str(layers / "exact_matmul_avx512.cpp"), "-o", objects[-1]])
        binary, lib = f"{folder}/kernel_ab", library_paths()[0]
        _compile(["c++", *flags, str(Path(__file__).with_name("exact_kernel_ab.cpp")), *objects, f"-L{lib}", "-lc10",
                  f"-Wl,-rpath,{lib}", "-o", binary])
        table_rows = []
        for label, qtype, inputs, outputs in SHAPES:
            chunk = 64 if outputs > 1024 else 32  # exact_matmul.cpp's pieces
            done = subprocess.run([binary, label.replace(" ", "_"), str(inputs), str(outputs), str(rows), str(chunk),
                                   str(4 * reps)], check=True, capture_output=True, text=True)
            _, a_best, a_median, b_best, b_median, equal = done.stdout.split()
            table_rows.append([label, f"{a_median} (best {a_best})", f"{b_median} (best {b_best})",
                               f"{float(b_median) / float(a_median):.2f}x", "yes" if equal == "1" else "NO"])
    print(f"\nkernel alone, one process, calls alternating, {rows} rows, 1 thread: GFLOP/s median (best) of "
          f"{4 * reps}; load average {os.getloadavg()[0]:.2f}\n")
    print(table(["shape", trees[0], trees[1], "B / A", "same bits"], table_rows))


def worker(jobs: list[str], rows: int, qwen: str | None) -> None:
    """One process: time the jobs, print one JSON line."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf import GGMLQuantizationType as QT
    from kquant_gguf import random_blocks

    import fastdecode
    from fastdecode.layers import ops
    from fastdecode.loading.gguf_blocks import repack

    result: dict[str, float | str] = {"tree": fastdecode.__file__}
    if "ops" in jobs:
        x = torch.randn(rows, max(s[2] for s in SHAPES), generator=torch.Generator().manual_seed(0))
        for label, qtype, inputs, outputs in SHAPES:
            w = repack(qtype, random_blocks(QT[qtype], (outputs, inputs), seed=1), (outputs, inputs), tile=True)
            xs = x[:, :inputs].contiguous()  # [rows, inputs]
            ms = _best_cpu_ms(lambda xs=xs, w=w: ops.exact_qmatmul(xs, w.codes, w.scale, w.mins, w.bits, w.group, 1,
                                                                  w.outputs), 5)
            result[label + " ms"] = ms
            result[label + " GFLOP/s"] = 2 * rows * inputs * outputs / ms / 1e6
    if "prompt" in jobs:
        result["embedded 512-token prompt CPU ms"] = _prompt_ms(fastdecode.load(None), 3)
    if "qwen" in jobs:
        result["Qwen 512-token prompt CPU ms"] = _prompt_ms(fastdecode.load(qwen), 2)
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="comma list of source folders (each put first on PYTHONPATH)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--jobs", default="kernel,ops,prompt")
    parser.add_argument("--qwen", default=None, help="a Qwen2.5 GGUF (job qwen: its 512-token prompt)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    jobs = args.jobs.split(",")
    unknown = set(jobs) - {"kernel", "ops", "prompt", "qwen"}
    if unknown:
        parser.error(f"unknown jobs {sorted(unknown)}: kernel, ops, prompt, qwen")
    if "qwen" in jobs and not args.qwen:
        parser.error("job qwen needs --qwen PATH (a Qwen2.5 GGUF)")
    if args.worker:
        worker(jobs, args.rows, args.qwen)
        return
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    print(machine_line("1"))
    if "kernel" in jobs:
        kernel_ab(trees, args.rows, args.reps)
        jobs.remove("kernel")
        if not jobs:
            return
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for rep in range(args.reps):
        for tree in trees:
            command = [sys.executable, __file__, "--worker", "--trees", tree, "--rows", str(args.rows),
                       "--jobs", ",".join(jobs)]
            if args.qwen:
                command += ["--qwen", args.qwen]
            result = run_in_tree(command, tree)
            runs[tree].append(result)
            print(f"  rep {rep + 1} {tree}: " + " ".join(f"{k}={v:.1f}" for k, v in result.items() if k != "tree"),
                  file=sys.stderr, flush=True)
    keys = [k for k in runs[trees[0]][0] if k != "tree"]
    rows = [[key, *(spread([r[key] for r in runs[tree]], 1) for tree in trees)] for key in keys]
    print(f"\n1 thread, {args.rows} rows, thread CPU time, {args.reps} reps: median (min-max); "
          f"load average {os.getloadavg()[0]:.2f} at the end\n")
    print(table(["measure", *trees], rows))


if __name__ == "__main__":
    main()
