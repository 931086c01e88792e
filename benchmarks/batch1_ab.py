#!/usr/bin/env python
"""Batch-1 greedy decoding of the embedded SmolLM2-135M Q4_1 under two source trees, A/B (issue 29).

    python benchmarks/batch1_ab.py --trees /work/main/src,/work/wt-b1/src [--threads 2,1] [--reps 5]
        [--new-tokens 64]

Each repetition runs one fresh process per tree and thread count, the trees alternating (drift in the
machine's load hits both alike), each with ``PYTHONPATH`` set to its tree. In it, after the warm-up of
benchmarks/qwen_coder_speed.py (a 1-token call, 64 prompt tokens with 4 new): three calls of the short
code prompt with 1 new token (the prompt and first token) and three with ``--new-tokens`` (the whole
call), alternating; the best of each. Reported per tree: the whole call's tok/s (qwen_coder_speed's
batch-1 row), the prompt call's ms, the decode steps' tok/s after the first token ((new tokens - 1) /
the difference), and the calling thread's CPU ms per decode step (at 1 thread the whole step's work,
robust to other processes' use of the cores). Medians over the repetitions with their range.

``--paired ROUNDS`` (two trees): one persistent process per tree instead, the whole call timed in rounds
A B B A, each round's ratio of the two trees' mean times (load that drifts over seconds hits both alike): the
ratio's median and quartiles, each tree's median tok/s. On a 2-core machine at load 5-8 its quartiles
spanned 3-6% where the per-process medians moved by 20%, but whole runs of it still moved by +-4%: repeat it.
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
from harness import machine_line, spread, table

PROMPT = "def quicksort(items):\n"


def worker(threads: int, new_tokens: int) -> None:
    """One process: warm up, time the calls, print one JSON line."""
    import torch

    torch.set_num_threads(threads)
    import fastdecode

    gen = fastdecode.load(None)
    prompt = gen.tokenizer.encode(PROMPT)
    long = gen.tokenizer.encode((Path(__file__).resolve().parents[1] / "README.md").read_text())
    gen.generate_ids([prompt], max_new_tokens=1, eos_token_id=[])
    gen.generate_ids([long[:64]], max_new_tokens=4, eos_token_id=[])

    def call(count: int) -> tuple[float, float]:
        cpu, start = time.thread_time(), time.perf_counter()
        gen.generate_ids([prompt], max_new_tokens=count, eos_token_id=[])
        return time.perf_counter() - start, time.thread_time() - cpu

    first, whole = [], []
    for _ in range(3):
        first.append(call(1))
        whole.append(call(new_tokens))
    (first_s, first_cpu), (whole_s, whole_cpu) = min(first), min(whole)
    print(json.dumps({"tree": fastdecode.__file__, "whole_tok_s": new_tokens / whole_s, "prompt_ms": first_s * 1e3,
                      "decode_tok_s": (new_tokens - 1) / (whole_s - first_s),
                      "step_cpu_ms": (whole_cpu - first_cpu) / (new_tokens - 1) * 1e3}))


def serve(threads: int) -> None:
    """A persistent worker (``--paired``): after the warm-up, one whole call per line read -> its seconds."""
    import torch

    torch.set_num_threads(threads)
    import fastdecode

    gen = fastdecode.load(None)
    prompt = gen.tokenizer.encode(PROMPT)
    gen.generate_ids([prompt], max_new_tokens=4, eos_token_id=[])
    print(json.dumps({"tree": fastdecode.__file__}), flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        gen.generate_ids([prompt], max_new_tokens=int(line), eos_token_id=[])
        print(time.perf_counter() - start, flush=True)


def paired(trees: list[str], threads: int, rounds: int, new_tokens: int) -> None:
    """Rounds A B B A of two persistent workers -> the per-round speed ratio B / A (see the docstring)."""
    workers = [subprocess.Popen([sys.executable, __file__, "--serve", str(threads), "--trees", tree],
                                env=dict(os.environ, PYTHONPATH=tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True) for tree in trees[:2]]
    for worker_process, tree in zip(workers, trees):
        if not json.loads(worker_process.stdout.readline())["tree"].startswith(tree):
            raise SystemExit(f"{tree}: fastdecode was imported from elsewhere")

    def call(index: int) -> float:
        workers[index].stdin.write(f"{new_tokens}\n")
        workers[index].stdin.flush()
        return float(workers[index].stdout.readline())

    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        a1, b1, b2, a2 = call(0), call(1), call(1), call(0)
        times[0].append((a1 + a2) / 2)
        times[1].append((b1 + b2) / 2)
    for worker_process in workers:
        worker_process.stdin.close()
        worker_process.wait()
    ratios = sorted(a / b for a, b in zip(*times))
    print(f"\n{threads} thread(s), {rounds} rounds A B B A, {new_tokens} new tokens; load average "
          f"{os.getloadavg()[0]:.2f} at the end\n")
    rows = [[tree, f"{new_tokens / sorted(t)[len(t) // 2]:.1f}"] for tree, t in zip(trees, times)]
    quartiles = f"{ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f}"
    rows.append(["B / A speed, per round", f"{ratios[len(ratios) // 2]:.3f} (quartiles {quartiles})"])
    print(table(["tree", f"{new_tokens} new tokens (tok/s, median)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="comma list of source folders (each put first on PYTHONPATH)")
    parser.add_argument("--threads", default="2,1")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--paired", type=int, default=0, help="rounds A B B A of two persistent workers")
    parser.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.new_tokens)
        return
    if args.serve:
        serve(args.serve)
        return
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    print(machine_line(args.threads))
    if args.paired:
        if len(trees) != 2:
            raise SystemExit("--paired compares two trees")
        for threads in (int(t) for t in args.threads.split(",")):
            paired(trees, threads, args.paired, args.new_tokens)
        return
    for threads in (int(t) for t in args.threads.split(",")):
        runs: dict[str, list[dict]] = {tree: [] for tree in trees}
        for rep in range(args.reps):
            for tree in trees:
                env = dict(os.environ, PYTHONPATH=tree)
                done = subprocess.run([sys.executable, __file__, "--worker", str(threads), "--trees", tree,
                                       "--new-tokens", str(args.new_tokens)], env=env, capture_output=True, text=True,
                                      check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if not result["tree"].startswith(tree):
                    raise SystemExit(f"{tree}: fastdecode was imported from {result['tree']}")
                runs[tree].append(result)
                print(f"  {threads}t rep {rep + 1} {tree}: " + " ".join(f"{k}={v:.2f}" for k, v in result.items()
                                                                         if k != "tree"), file=sys.stderr, flush=True)
        rows = [[tree, *(spread([r[key] for r in runs[tree]], digits) for key, digits in
                         (("whole_tok_s", 1), ("prompt_ms", 1), ("decode_tok_s", 1), ("step_cpu_ms", 2)))]
                for tree in trees]
        print(f"\n{threads} thread(s), {args.reps} reps, {args.new_tokens} new tokens: median (min-max); "
              f"load average {os.getloadavg()[0]:.2f} at the end\n")
        print(table(["tree", f"{args.new_tokens} new tokens (tok/s)", "prompt + first token (ms)",
                     "decode steps after it (tok/s)", "caller CPU per step (ms)"], rows))


if __name__ == "__main__":
    main()
