#!/usr/bin/env python
"""One prompt's processing under two source trees, A/B (issue 29's embedded prompt row).

    python benchmarks/prompt_ab.py --trees /work/main/src,/work/wt-x/src [--reps 6] [--tokens 512] [--threads 2]
        [--prompt-rows int8-mlp] [--model PATH.gguf] [--ops]

Each repetition runs one fresh process per tree, in the order A B B A (drift in the machine's load hits both
alike), each with ``PYTHONPATH`` set to its tree. A process loads the model (the embedded SmolLM2-135M Q4_1 GGUF
unless ``--model``), warms up on a 64-token prompt, then times ``--calls`` calls of a ``--tokens``-token prompt
(README text, 1 new token): on ``--threads`` threads (wall seconds: tok/s, best call) and on 1 thread (the
process's CPU time: the steadiest figure on a shared machine, best call). ``--ops``: where the 1-thread call's time
went, per op of ``fastdecode.layers.ops`` (CPU ms; the rest is Python and torch). Prints medians (min-max) over
the repetitions, the ratio B / A of the medians, and whether both trees gave the same tokens and log-probs.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_line, median, run_in_tree, spread, table

ROOT = Path(__file__).resolve().parents[1]


def _op_timers() -> dict[str, float]:
    """Wraps every public function of fastdecode.layers.ops with a CPU-time counter: name -> seconds."""
    import inspect

    from fastdecode.layers import ops

    spent: dict[str, float] = collections.defaultdict(float)

    def wrap(name, function):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.process_time() - start
        return timed

    for name, function in list(vars(ops).items()):
        if inspect.isfunction(function) and function.__module__ == ops.__name__ and not name.startswith("_"):
            setattr(ops, name, wrap(name, function))
    return spent


def worker(args: argparse.Namespace) -> None:
    """One process: time the prompt, print one JSON line."""
    import torch

    spent = _op_timers() if args.ops else None
    import fastdecode

    options = {"prompt_rows": args.prompt_rows} if args.prompt_rows else {}
    gen = fastdecode.load(args.model, **options)
    ids = gen.tokenizer.encode((ROOT / "README.md").read_text() * 4)[:args.tokens]  # [tokens] token ids
    run = lambda: gen.generate_ids([ids], max_new_tokens=1, eos_token_id=[])
    result: dict[str, float | str] = {"tree": fastdecode.__file__}
    digest = hashlib.sha256(json.dumps([run(), gen.score(ids[:128])]).encode()).hexdigest()[:16]
    result["digest"] = digest
    for threads in (args.threads, 1):
        torch.set_num_threads(threads)
        gen.generate_ids([ids[:64]], max_new_tokens=1, eos_token_id=[])  # warm-up at this thread count
        best_wall = best_cpu = float("inf")
        for _ in range(args.calls):
            if spent is not None:
                spent.clear()
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best_wall = min(best_wall, wall)
            if cpu < best_cpu and threads == 1 and spent is not None:
                result.update({f"1 thread CPU ms: {name}": 1e3 * s for name, s in spent.items() if s >= 5e-4})
            best_cpu = min(best_cpu, cpu)
        if threads == args.threads:
            result[f"{threads} threads tok/s"] = args.tokens / best_wall
        if threads == 1:
            result["1 thread CPU ms"] = 1e3 * best_cpu
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", required=True, help="two source folders, comma-separated (each put on PYTHONPATH)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--calls", type=int, default=3, help="timed calls per process and thread count (best)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-rows", default=None, help="load's prompt_rows (default: load's own default)")
    parser.add_argument("--model", default=None, help="a GGUF (default: the embedded model)")
    parser.add_argument("--ops", action="store_true", help="per-op CPU ms of the 1-thread call")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    if len(trees) != 2:
        parser.error("--trees takes two source folders")
    forwarded = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
                 if name not in ("trees", "reps", "worker", "ops") and value is not None]
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for rep in range(args.reps):
        for tree in (trees if rep % 2 == 0 else trees[::-1]):
            command = [sys.executable, __file__, "--worker", "--trees", args.trees, *forwarded,
                       *(["--ops"] if args.ops else [])]
            result = run_in_tree(command, tree)
            runs[tree].append(result)
            print(f"  rep {rep + 1} {tree}: " + " ".join(f"{k}={v:.1f}" for k, v in result.items()
                                                          if isinstance(v, float)), file=sys.stderr, flush=True)
    keys = sorted({k for tree in trees for r in runs[tree] for k, v in r.items() if isinstance(v, float)},
                  key=lambda k: (": " in k, k))
    rows = []
    for key in keys:
        values = [[r.get(key, 0.0) for r in runs[tree]] for tree in trees]
        a, b = median(values[0]), median(values[1])
        rows.append([key, spread(values[0], 1), spread(values[1], 1), f"{b / a:.3f}" if a else "-"])
    same = len({r["digest"] for tree in trees for r in runs[tree]}) == 1
    print(f"\n{machine_line(args.threads)}\n\n{args.tokens}-token prompt, {args.reps} reps (A B B A), best of "
          f"{args.calls} calls per process: median (min-max); load average {os.getloadavg()[0]:.2f} at the end; "
          f"same tokens and log-probs in every process: {'yes' if same else 'NO'}\n")
    print(table(["measure", f"A {trees[0]}", f"B {trees[1]}", "B / A"], rows))


if __name__ == "__main__":
    main()
