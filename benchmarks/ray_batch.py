"""`fastdecode batch` in one process (2 torch threads) vs on Ray (2 actors x 1 thread), side by side.

    python benchmarks/ray_batch.py                 # 512 prompts, 2 alternating rounds (embedded model)
    python benchmarks/ray_batch.py --prompts 128 --rounds 1    # a smaller run

Both variants run the same input (``pipeline_speed.make_prompts``: short prompts of 8-60 tokens)
through the same batch pipeline (length-bucketed batches of ``--batch-size``, greedy,
``--max-new-tokens``) into a .jsonl file, each in a fresh worker process (this script re-runs
itself with ``--role``), alternating within every round; the table gives medians over rounds.
The two outputs must be byte-identical (checked every round).

* single: ``BatchRun`` in the worker process, torch with 2 threads.
* single1 (``--one-thread``): the same with 1 torch thread, for reference.
* ray: a local Ray started by the worker (``local_ray``, 2 CPUs), 2 actors with 1 CPU and
  1 torch thread each, the ``fastdecode batch --ray`` driver path (``ray_records``).

Reported phases (seconds from the worker's start of work, after its imports):
* single: ``load`` (model), ``first`` (first record written), ``total``.
* ray: ``start`` (Ray's local instance up), ``put`` (input parsed, encoded into Arrow blocks and
  put in the object store: the input-side serialization), ``first`` (first record back: includes
  each actor's process start, imports and model load), ``total``; ``decode`` is the time to parse
  every record line once more (the driver's extra per-record work: actors send records as JSON).
samples/s counts the whole run (startup included); "after start-up" leaves out the model load
(single) or Ray's start and the input put (ray), but not the actors' own start and model load,
which overlap the first batches.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def run_single(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(1 if args.role == "single1" else 2)
    from fastdecode import load
    from fastdecode.pipeline import BatchRun, BatchSettings
    from fastdecode.pipeline.cli import read_input
    from fastdecode.pipeline.output import OutputFile

    started = time.perf_counter()
    gen = load()
    phases = {"load": time.perf_counter() - started}
    writer = OutputFile(args.output, overwrite=True)
    settings = BatchSettings(batch_size=args.batch_size, chat=True)
    run = BatchRun(gen, read_input(args.input, "jsonl", "prompt"), settings,
                   {"max_new_tokens": args.max_new_tokens}, on_records=writer)
    for count, _ in enumerate(run, start=1):
        if count == 1:
            phases["first"] = time.perf_counter() - started
    writer.close()
    phases["total"] = time.perf_counter() - started
    return phases


def run_ray(args: argparse.Namespace) -> dict:
    from fastdecode.integrations.ray_batch import RayOptions, input_dataset, local_ray, ray_records
    from fastdecode.pipeline.cli import read_input
    from fastdecode.pipeline.output import OutputFile

    options = RayOptions(address="local", actors=2, cpus_per_actor=1)
    predictor = dict(model=None, options={"max_new_tokens": args.max_new_tokens}, chat=True,
                     batch_size=args.batch_size)
    started = time.perf_counter()
    phases = {}
    with local_ray(num_cpus=2):
        phases["start"] = time.perf_counter() - started
        put_started = time.perf_counter()
        input_dataset(read_input(args.input, "jsonl", "prompt"), args.batch_size)  # the same work, timed alone
        phases["put"] = time.perf_counter() - put_started
        writer = OutputFile(args.output, overwrite=True)
        for ready in ray_records(read_input(args.input, "jsonl", "prompt"), predictor, options, 128, args.prompts):
            phases.setdefault("first", time.perf_counter() - started - phases["put"])
            writer(ready)
        writer.close()
        phases["total"] = time.perf_counter() - started - phases["put"]  # the timed-alone put is not the run's
    lines = Path(args.output).read_text(encoding="utf-8").splitlines()
    decode_started = time.perf_counter()
    for line in lines:  # what the driver does per record on top of the single-process path
        json.loads(line)
    phases["decode"] = time.perf_counter() - decode_started
    return phases


def worker(args: argparse.Namespace) -> None:
    phases = run_ray(args) if args.role == "ray" else run_single(args)
    print("RESULT " + json.dumps(phases), flush=True)


def spawn(role: str, args: argparse.Namespace, input_path: Path, output: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2" if role == "single" else "1"}
    command = [sys.executable, __file__, "--role", role, "--input", str(input_path), "--output", str(output),
               "--prompts", str(args.prompts), "--batch-size", str(args.batch_size),
               "--max-new-tokens", str(args.max_new_tokens)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{role} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one-thread", action="store_true",
                        help="also a single process with 1 thread (how fast one core is, for reference)")
    parser.add_argument("--role", choices=["single", "single1", "ray"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--input", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        worker(args)
        return

    from pipeline_speed import make_prompts

    folder = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    source = folder / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in make_prompts(args.prompts)))
    print(f"{args.prompts} prompts, batch {args.batch_size}, {args.max_new_tokens} new tokens, embedded model, "
          f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}", flush=True)
    roles = ("single", "ray", "single1") if args.one_thread else ("single", "ray")
    results: dict[str, list[dict]] = {role: [] for role in roles}
    for round_index in range(args.rounds):
        outputs = {}
        for role in roles if round_index % 2 == 0 else roles[::-1]:
            outputs[role] = folder / f"{role}-{round_index}.jsonl"
            phases = spawn(role, args, source, outputs[role])
            results[role].append(phases)
            print(f"round {round_index + 1} {role}: " + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items())
                  + f" (load avg {os.getloadavg()[0]:.1f})", flush=True)
        if any(outputs[role].read_bytes() != outputs["single"].read_bytes() for role in roles):
            raise SystemExit(f"round {round_index + 1}: the outputs differ")
    report(results, args.prompts)


def report(results: dict[str, list[dict]], prompts: int) -> None:
    def median(role: str, key: str) -> float:
        return statistics.median(phases[key] for phases in results[role])

    single_total, ray_total = median("single", "total"), median("ray", "total")
    single_ready = median("single", "load")
    ray_ready = median("ray", "start") + median("ray", "put")
    print("\n| variant | ready to generate | first record | total | samples/s | samples/s after start-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| single process, 2 threads | {single_ready:.1f} s (model load) | {median('single', 'first'):.1f} s "
          f"| {single_total:.1f} s | {prompts / single_total:.2f} | {prompts / (single_total - single_ready):.2f} |")
    if "single1" in results:
        total, ready = median("single1", "total"), median("single1", "load")
        print(f"| single process, 1 thread | {ready:.1f} s (model load) | {median('single1', 'first'):.1f} s "
              f"| {total:.1f} s | {prompts / total:.2f} | {prompts / (total - ready):.2f} |")
    print(f"| Ray, 2 actors x 1 thread | {ray_ready:.1f} s (Ray start + input put; actors load after) "
          f"| {median('ray', 'first'):.1f} s | {ray_total:.1f} s | {prompts / ray_total:.2f} "
          f"| {prompts / (ray_total - ray_ready):.2f} |")
    print(f"\nRay / single: {single_total / ray_total:.2f}x samples/s end to end. Ray overhead: start "
          f"{median('ray', 'start'):.1f} s, input encode + put {median('ray', 'put') * 1000:.0f} ms, record decode "
          f"{median('ray', 'decode') * 1000:.0f} ms, first record {median('ray', 'first') - median('single', 'first'):+.1f} s "
          "vs single (actor processes, imports, one model load per actor)")


if __name__ == "__main__":
    main()
