"""`fastdecode batch` in one process (2 torch threads) vs on Ray (2 actors x 1 thread), side by side.

    python benchmarks/ray_batch.py                 # 512 prompts, 2 alternating rounds (embedded model)
    python benchmarks/ray_batch.py --prompts 128 --rounds 1    # a smaller run

Both variants run the same input (``pipeline_speed.make_prompts``: short prompts of 8-60 tokens)
through the public command, ``fastdecode batch IN -o OUT`` (length-bucketed batches of
``--batch-size``, greedy, ``--max-new-tokens``, chat template), each a fresh process, alternating
within every round; the table gives medians (min-max) over rounds. The outputs must be
byte-identical (checked every round).

* single: ``fastdecode batch`` with 2 torch threads (OMP_NUM_THREADS=2).
* single1 (``--one-thread``): the same with 1 thread, for reference.
* ray: ``fastdecode batch --ray local --actors 2 --cpus-per-actor 1``: a private local Ray, 2 actors
  with 1 CPU and 1 torch thread each.

Reported: seconds from process start to the first record in the output file (imports, model load;
for Ray also its start, the input put and each actor's start and load) and to the exit; samples/s
over the whole run. Needs the ``ray`` extra (``make install-dev`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import median, spread, table
from pipeline_speed import add_workload_arguments, make_prompts

VARIANTS = {"single": ("2", []), "single1": ("1", []),
            "ray": ("1", ["--ray", "local", "--actors", "2", "--cpus-per-actor", "1"])}
LABELS = {"single": "single process, 2 threads", "single1": "single process, 1 thread",
          "ray": "Ray, 2 actors x 1 thread"}


def run_variant(name: str, args: argparse.Namespace, source: Path, output: Path) -> dict[str, float]:
    """Seconds from the start of ``fastdecode batch`` to its first output record and to its exit."""
    threads, extra = VARIANTS[name]
    cli = Path(sys.executable).with_name("fastdecode")
    command = [str(cli), "batch", str(source), "-o", str(output), "-q", "--overwrite", "--batch-size",
               str(args.batch_size), "--max-new-tokens", str(args.max_new_tokens), *extra]
    started = time.perf_counter()
    process = subprocess.Popen(command, env=harness.quiet_env(OMP_NUM_THREADS=threads), stderr=subprocess.PIPE,
                               text=True)
    first = None
    while process.poll() is None:
        if first is None and output.exists() and output.stat().st_size:
            first = time.perf_counter() - started
        time.sleep(0.02)
    total = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{name} failed ({process.returncode}):\n{process.stderr.read()[-3000:]}")
    return {"first": first if first is not None else total, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--one-thread", action="store_true",
                        help="also a single process with 1 thread (how fast one core is, for reference)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(args.prompts)))
    print(f"{args.prompts} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, embedded model; "
          f"{harness.machine_line(2)}", flush=True)
    names = ("single", "ray", "single1") if args.one_thread else ("single", "ray")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        outputs = {}
        for name in names if round_index % 2 == 0 else names[::-1]:
            outputs[name] = folder / f"{name}-{round_index}.jsonl"
            results[name].append(run_variant(name, args, source, outputs[name]))
            print(f"round {round_index + 1} {name}: {results[name][-1]} (load avg {os.getloadavg()[0]:.1f})",
                  file=sys.stderr, flush=True)
        if any(outputs[name].read_bytes() != outputs["single"].read_bytes() for name in names):
            raise SystemExit(f"round {round_index + 1}: the outputs differ")
    rows = [[LABELS[name], spread([r["first"] for r in runs]), spread([r["total"] for r in runs]),
             spread([args.prompts / r["total"] for r in runs], 2)] for name, runs in results.items()]
    print("\n" + table(["variant", "first record s", "total s", "samples/s"], rows))
    single, ray = (median(r["total"] for r in results[name]) for name in ("single", "ray"))
    print(f"\nRay / single: {single / ray:.2f}x samples/s end to end (outputs byte-identical in every round).")


if __name__ == "__main__":
    main()
