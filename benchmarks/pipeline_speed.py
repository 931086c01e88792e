"""Batch pipeline vs a synchronous loop, side by side on the embedded SmolLM2-135M-Instruct.

    python benchmarks/pipeline_speed.py            # 512 prompts, 2 alternating rounds (~4-5 min, idle 2 cores)
    python benchmarks/pipeline_speed.py --quick    # 128 prompts (~2 min)

Times are for an idle 2-core machine; when other jobs share the cores, expect several times more
(a 3-round run took 24 minutes at a load average of 2-4).

Both variants do the same work per input: tokenize, generate
``--max-new-tokens`` greedy tokens, detokenize, build the output record, run a per-record
post-processing step of ``--post-ms`` milliseconds, and append the record to a .jsonl file
(flushed).

* sync: one batch after the other, in input order (tokenize -> generate -> detokenize -> write).
* pipeline: ``Generator.batch`` (FastSeq 4.3): reading/tokenizing, detokenizing and the
  ``postprocess`` hook (in completion order) overlap generation in background threads, the
  ``on_records`` hook appends in input order; one long-lived engine generates ``--batch-size``
  inputs at once, each finished one replaced at once (continuous batching).

Why a post-processing cost: with Rust tokenizers, tokenizing and detokenizing 16 short prompts
take well under a millisecond, so without real post-processing there is nothing to overlap on
this machine (run with --post-ms 0 to see it). Real batch jobs do more per record: writing to a
network store or a database, calling a scorer or a filter; FastSeq (Figure 1a, section 5.4)
measured post-processing at about 38% of the end-to-end time of its baselines. By default the
cost is calibrated so that post-processing is ``--post-share`` (0.3) of the synchronous loop:
``post_ms = share / (1 - share) * (one batch's generation time) / batch_size``, measured on a
warm-up batch; ``--post-ms`` sets it directly. ``--post-kind sleep`` (the default) models I/O
waits with ``time.sleep``; ``--post-kind cpu`` spins in Python instead (holding the GIL), which
competes with torch for the same cores and so overlaps less.

Torch threads: one by default. On a 2-core machine shared with other jobs, two torch threads
collapse (every parallel region waits for a descheduled thread: 2.5-6x slower per batch in our
runs); pass --threads 2 on a quiet machine.

Variants alternate within each round; the table reports medians over rounds and the ratio to
the sync loop, and the share of each stage in the sync loop's time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch

import fastdecode
import harness
from harness import median, spread, table

TOPICS = ["rivers", "the moon", "bread", "chess", "volcanoes", "jazz", "bees", "glass", "trains", "salt",
          "clouds", "maps", "tea", "bridges", "owls", "copper"]
WORDS = ("in a clear and friendly way for a curious reader who knows a little about science history "
         "everyday life wants one more fact to remember using simple words short sentences examples from "
         "home school travel work nature cities markets").split()


def make_prompts(n: int, seed: int = 0) -> list[str]:
    """Seeded short prompts whose lengths spread evenly over about 8 to 60 tokens.

    Continuous lengths matter: with a handful of distinct lengths, every input of a batch would
    finish its prompt in the same step, which flatters any batching scheme.
    """
    rng = random.Random(seed)
    return [f"Write one sentence about {rng.choice(TOPICS)} "
            + " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 50))) + "." for _ in range(n)]


class PostProcess:
    """``postprocess``: spend ``ms`` on a record (sleep or CPU spin); ``write``: append + flush."""

    def __init__(self, path: Path, ms: float, kind: str):
        self.handle = open(path, "w", encoding="utf-8")
        self.seconds, self.kind = ms / 1000.0, kind

    def postprocess(self, record: dict) -> dict:
        if self.kind == "sleep":
            time.sleep(self.seconds)
        else:
            end = time.perf_counter() + self.seconds
            while time.perf_counter() < end:
                pass
        return record

    def write(self, records: list[dict]) -> None:
        for record in records:
            self.handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.handle.flush()

    def close(self) -> None:
        self.handle.close()


def run_sync(gen, prompts, args, post) -> dict:
    """Tokenize, generate, detokenize and post-process one batch after the other."""
    times = {"tokenize": 0.0, "generate": 0.0, "detokenize": 0.0, "write+post": 0.0}
    options = {"max_new_tokens": args.max_new_tokens}
    started = time.perf_counter()
    for start in range(0, len(prompts), args.batch_size):
        chunk = prompts[start:start + args.batch_size]
        t0 = time.perf_counter()
        ids = [gen.encode_prompt(p) for p in chunk]
        t1 = time.perf_counter()
        results = gen.generate_ids_with_details(ids, **options)
        t2 = time.perf_counter()
        texts = gen.decode_results(results, **options)
        records = [{"id": start + k, "line": start + k + 1, "prompt": p, "output": t, "num_tokens": len(r.tokens),
                    "finish_reason": r.finish_reason} for k, (p, t, r) in enumerate(zip(chunk, texts, results))]
        t3 = time.perf_counter()
        post.write([post.postprocess(record) for record in records])
        t4 = time.perf_counter()
        for name, seconds in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            times[name] += seconds
    times["wall"] = time.perf_counter() - started
    return times


def run_pipeline(gen, prompts, args, post) -> dict:
    started = time.perf_counter()
    run = gen.batch(prompts, batch_size=args.batch_size, postprocess=post.postprocess,
                    on_records=post.write, max_new_tokens=args.max_new_tokens)
    count = sum(1 for _ in run)
    assert count == len(prompts)
    s = run.stats
    return {"read+tokenize": s.read_s, "generate": s.generate_s, "detokenize+write+post": s.post_s,
            "generate waits for reader": s.starve_s, "wall": time.perf_counter() - started}


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch workload's flags, shared with ray_batch.py."""
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--post-ms", type=float, default=None, help="post-processing cost per record (ms)")
    parser.add_argument("--post-share", type=float, default=0.3,
                        help="calibrate --post-ms so post-processing is this share of the sync loop")
    parser.add_argument("--post-kind", choices=["sleep", "cpu"], default="sleep")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="128 prompts")
    args = parser.parse_args()
    if args.quick:
        args.prompts = min(args.prompts, 128)
    if args.threads:
        torch.set_num_threads(args.threads)  # before any torch work

    gen = fastdecode.load()
    prompts = make_prompts(args.prompts)
    lengths = [len(gen.encode_prompt(p)) for p in prompts]
    warm = [gen.encode_prompt(p) for p in prompts[: args.batch_size]]
    gen.generate_ids(warm, max_new_tokens=2)  # first-call overheads
    if args.post_ms is None:
        started = time.perf_counter()
        gen.generate_ids(warm, max_new_tokens=args.max_new_tokens)
        batch_s = time.perf_counter() - started
        args.post_ms = 1000 * args.post_share / (1 - args.post_share) * batch_s / args.batch_size

    variants = {"sync": lambda post: run_sync(gen, prompts, args, post),
                "pipeline": lambda post: run_pipeline(gen, prompts, args, post)}
    load_before = os.getloadavg()[0]
    print(f"{args.prompts} prompts ({min(lengths)}-{max(lengths)} tokens), batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, post {args.post_ms:.1f} ms/record ({args.post_kind}); "
          f"{harness.machine_line(torch.get_num_threads())}", flush=True)

    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as folder:
        for round_index in range(args.rounds):
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in order:
                post = PostProcess(Path(folder) / f"{name}.jsonl", args.post_ms, args.post_kind)
                try:
                    results[name].append(variants[name](post))
                finally:
                    post.close()
                print(f"  round {round_index + 1} {name:18s} {results[name][-1]['wall']:7.2f} s", flush=True)

    sync_rate = median(args.prompts / r["wall"] for r in results["sync"])
    rates = {name: [args.prompts / r["wall"] for r in runs] for name, runs in results.items()}
    print("\n" + table(["variant", "samples/s: median (min-max)", "vs sync"],
                       [[name, spread(r, 2), f"{median(r) / sync_rate:.2f}x"] for name, r in rates.items()]))
    for name, runs in results.items():
        wall = median(r["wall"] for r in runs)
        stages = [k for k in runs[0] if k != "wall"]
        shares = ", ".join(f"{k} {median(r[k] for r in runs) / wall:.1%}" for k in stages)
        print(f"stage time / wall, {name}: {shares}")
    print(f"load avg {load_before:.1f} -> {os.getloadavg()[0]:.1f} (other processes share these cores)")

if __name__ == "__main__":
    main()
