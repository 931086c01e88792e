#!/usr/bin/env python
"""serve_load.py's 16-client float32 workload on the engine itself, no HTTP, under two source trees, A/B.

    python benchmarks/serve_engine_ab.py --trees /work/main/src,src [--threads 2] [--reps 3] [--clients 16]

Each repetition runs one fresh process per tree, the trees alternating (drift in the machine's load hits both
alike), each with ``PYTHONPATH`` set to its tree. In it: the embedded SmolLM2-135M dequantized to float32 (what
``serve_load.py --servers fastdecode-float32`` serves), an engine as ``fastdecode serve`` makes it, run by a
thread of its own as the server's worker runs it, on ``--threads`` torch threads; serve_load.py's warm-up (its
first request alone), then its level: ``--clients`` closed-loop clients, each submitting its ``--requests``
chat requests (serve_load's seeded list, greedy, chat template applied) one after the other, the next as the
last one ends. Twice: "cold", every prompt new to the engine (serve_load's first repetition), and "warm", the
same requests again, their prompts' full blocks in the prefix cache (serve_load's later repetitions).
Reported per tree and run: output tok/s, time to first token (p50, p99: from submission to the step that
sampled it) and the engine thread's CPU seconds. Without the HTTP server and client beside it, the figures
move less with the machine's load than serve_load.py's, and show what the engine's step does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import machine_line, median, percentile, spread, table


def run_level(engine, prompts: list[tuple[list[int], int]], clients: int, per_client: int) -> dict:
    """Closed-loop clients on the engine -> tok/s, TTFT p50/p99 (s), the calling thread's CPU seconds."""
    queues = {c: [prompts[(c * per_client + k) % len(prompts)] for k in range(per_client)] for c in range(clients)}
    owner, sent, first, tokens = {}, {}, {}, 0

    def submit(client: int) -> None:
        ids, max_tokens = queues[client].pop(0)
        sequence = engine.submit(ids, {"max_new_tokens": max_tokens, "do_sample": False})
        owner[sequence.id], sent[sequence.id] = client, time.perf_counter()

    started, cpu = time.perf_counter(), time.thread_time()
    for client in range(clients):
        submit(client)
    while engine.has_work():
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            sequence = event.sequence
            first.setdefault(sequence.id, now - sent[sequence.id])
            if sequence.finished and sequence.id in owner:
                tokens += sequence.num_tokens - len(sequence.prompt_ids)
                client = owner.pop(sequence.id)
                if queues[client]:
                    submit(client)
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    ttft = list(first.values())
    return {"tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "cpu_s": cpu}


def worker(threads: int, clients: int, per_client: int) -> None:
    """One process: load, warm up, the cold and the warm level; one JSON line."""
    import torch
    from serve_load import workload

    import fastdecode

    torch.set_num_threads(threads)
    generator = fastdecode.load(quantize="dequantize")
    tokenizer = generator.requests.require_tokenizer()
    prompts = [(tokenizer.encode(tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True),
                                 add_special_tokens=False), r["max_tokens"]) for r in workload(64)]
    results: dict[str, dict] = {}

    def serve() -> None:  # on a thread of its own, as the server's engine worker (serve/worker.py)
        engine = generator.engine()
        run_level(engine, prompts[:1], 1, 1)  # serve_load's warm-up
        results["cold"] = run_level(engine, prompts, clients, per_client)
        results["warm"] = run_level(engine, prompts, clients, per_client)

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()
    print(json.dumps(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", help="comma-separated src/ folders (A,B)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2, help="requests per client")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.threads, args.clients, args.requests)
        return
    if not args.trees or len(args.trees.split(",")) != 2:
        parser.error("--trees takes two src/ folders, A,B")
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    runs: dict[str, list[dict]] = {tree: [] for tree in trees}
    for rep in range(args.reps):
        for tree in trees if rep % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": str(args.threads)}
            done = subprocess.run([sys.executable, __file__, "--worker", "--threads", str(args.threads), "--clients",
                                   str(args.clients), "--requests", str(args.requests)],
                                  env=env, capture_output=True, text=True, check=True)
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"[rep {rep + 1}] {tree}: {runs[tree][-1]}", file=sys.stderr, flush=True)
    print(f"# serve_engine_ab: {args.clients} clients x {args.requests} requests, float32 SmolLM2-135M, "
          f"{args.reps} process(es) per tree: medians (range)\n")
    print(machine_line(args.threads) + "\n")
    rows = []
    for kind in ("cold", "warm"):
        for tree in trees:
            values = {key: [r[kind][key] for r in runs[tree]] for key in ("tok_s", "ttft_p50", "ttft_p99", "cpu_s")}
            rows.append([kind, tree, spread(values["tok_s"]), spread(values["ttft_p50"], 2),
                         spread(values["ttft_p99"], 2), spread(values["cpu_s"], 2)])
        base, other = (median(r[kind]["tok_s"] for r in runs[tree]) for tree in trees[:2])
        rows.append([kind, "B / A tok/s", f"{other / base:.2f}x", "", "", ""])
    print(table(["run", "tree", "output tok/s", "TTFT p50 (s)", "TTFT p99 (s)", "engine thread CPU (s)"], rows))


if __name__ == "__main__":
    main()
