#!/usr/bin/env python
"""The layered slot cache (issue 14): KV bytes held vs context, and decode speed against main.

A random model with Gemma 3 270M's attention (18 layers, five sliding layers of window 512 then
one global, 4 query heads, 1 KV head of 256; narrower MLP and vocabulary so the prefills of long
contexts stay affordable on a CPU) runs in worker processes:

* memory: one sequence prefilled to each context (512 .. 8192); the K/V bytes its blocks hold,
  per kind, read from the engine's pools at the first decode step, next to what a cache that keeps
  every layer's K/V for the whole context (main's) holds for the same tokens;
* speed: decode steps at batch 1 and 8, this checkout's ``src`` against another checkout's
  (``--base-src``, default /work/main/src), in alternating worker processes (A, B, A, B ...),
  medians with their range and the ratio.

    python benchmarks/layered_cache.py --quick        # memory at 512 and 2048, speed at 512, 2 repetitions
    python benchmarks/layered_cache.py                # contexts 512 .. 8192
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import harness
from harness import median, spread, table

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=18, num_attention_heads=4,
             num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
             vocab_size=4096, max_position_embeddings=32768)


def worker(args: argparse.Namespace) -> None:
    """Child: build the model, prefill ``batch`` prompts of ``context`` tokens, time decode steps ->
    one JSON line on stdout."""
    import time

    import torch
    import transformers as tf

    import fastdecode

    torch.manual_seed(0)
    layer_types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(18)]
    hf = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**SHAPE, layer_types=layer_types)).eval()
    gen = fastdecode.from_hf(hf)
    batch, context, steps = args.batch, args.context, args.steps
    # Enough new tokens that no sequence ends before every one has read its prompt (the engine
    # decodes the first ones while later prompts still read in chunks); cancelled after the timing.
    new_tokens = steps + 2 + batch * context // 128
    engine = gen.engine(max_batch_tokens=2048, max_queue=batch, cache_tokens=batch * (context + new_tokens + 32))
    sequences = []
    for row in range(batch):
        prompt = [(7 * row + 13 * i) % (SHAPE["vocab_size"] - 3) + 3 for i in range(context)]
        sequences.append(engine.submit(prompt, {"max_new_tokens": new_tokens, "eos_token_id": []}))
    started, times, cpu_times, held = set(), [], [], None
    cache = engine.cache
    per_token: dict[str, int] = {}  # K/V bytes per token of each kind this checkout's cache keeps
    for window in getattr(cache, "layer_windows", [None] * SHAPE["num_hidden_layers"]):
        kind = "full" if window is None else f"sliding (window {window})"
        per_token[kind] = per_token.get(kind, 0) + 2 * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 4
    while engine.has_work():
        decoding = len(started) == batch  # every prompt is read: the step decodes ``batch`` rows
        if len(times) == steps + 1:
            for sequence in sequences:
                sequence.cancel()
        began, began_cpu = time.perf_counter(), time.process_time()
        events = engine.step()
        if decoding and len(events) == batch:
            times.append(time.perf_counter() - began)
            cpu_times.append(time.process_time() - began_cpu)
            if held is None and hasattr(cache, "held_tokens"):
                held = {kind: tokens * per_token[kind] for kind, tokens in cache.held_tokens().items()}
        started |= {event.sequence.id for event in events}
    print(json.dumps({"step_s": median(times[1:]), "step_cpu_s": median(cpu_times[1:]), "held_bytes": held,
                      "every_layer_bytes": sum(per_token.values()) * batch * (context + 1)}))


def run_child(src: str, batch: int, context: int, steps: int, threads: int) -> dict:
    env = harness.quiet_env(PYTHONPATH=os.pathsep.join([src, str(HERE)]), OMP_NUM_THREADS=str(threads))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--batch", str(batch),
               "--context", str(context), "--steps", str(steps)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"worker failed ({src}, batch {batch}, context {context}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 512 and 2048, 2 repetitions")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per run")
    parser.add_argument("--threads", type=int, default=harness.cpu_count())
    parser.add_argument("--base-src", default="/work/main/src", help="the checkout to compare with (main)")
    parser.add_argument("--speed-only", action="store_true", help="skip the memory table")
    parser.add_argument("--speed-rows", default="", help="BATCHxCONTEXT,... (default 1x512,1x2048,8x512,8x2048)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=512, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    ours = str(HERE.parent / "src")
    reps = 2 if args.quick else args.reps
    memory_contexts = [512, 2048] if args.quick else [512, 1024, 2048, 4096, 8192]
    speed_rows = [(1, 512), (8, 512)] if args.quick else [(1, 512), (1, 2048), (8, 512), (8, 2048)]
    if args.speed_rows:
        speed_rows = [tuple(int(x) for x in row.split("x")) for row in args.speed_rows.split(",")]
    print(harness.machine_line(args.threads))
    contention = harness.Contention()

    rows = []
    for context in [] if args.speed_only else memory_contexts:
        result = run_child(ours, 1, context, args.steps, args.threads)
        held = result["held_bytes"]
        rows.append([context, *(f"{held[k] / 2**20:.2f}" for k in sorted(held)), f"{sum(held.values()) / 2**20:.2f}",
                     f"{result['every_layer_bytes'] / 2**20:.2f}",
                     f"{result['every_layer_bytes'] / sum(held.values()):.1f}x"])
        print(f"  memory, context {context}: done", file=sys.stderr, flush=True)
    if rows:
        print("\n## KV bytes one sequence holds (MiB, fp32, at its first decode step)\n")
        print(table(["context", *sorted(held), "layered total", "every layer, every token (main, computed)",
                     "saving"], rows))

    rows = []
    for batch, context in speed_rows:
        times: dict[str, list[float]] = {"main": [], "layered": []}
        cpu: dict[str, list[float]] = {"main": [], "layered": []}
        for rep in range(reps):
            for name, src in (("main", args.base_src), ("layered", ours)):
                result = run_child(src, batch, context, args.steps, args.threads)
                times[name].append(result["step_s"] * 1e3)
                cpu[name].append(result["step_cpu_s"] * 1e3)
            print(f"  speed, batch {batch}, context {context}, rep {rep + 1}/{reps}", file=sys.stderr, flush=True)
        rows.append([batch, context, spread(times["main"]), spread(times["layered"]),
                     f"{median(times['main']) / median(times['layered']):.2f}x", spread(cpu["main"]),
                     spread(cpu["layered"]), f"{median(cpu['main']) / median(cpu['layered']):.2f}x"])
    print("\n## Decode step (ms, median (min-max) over alternating worker processes; CPU ms: the process's own)\n")
    print(table(["batch", "context", "main", "layered", "main / layered", "main CPU", "layered CPU",
                 "main / layered CPU"], rows))
    print(f"\nOther processes kept {contention.other_cores():.2f} cores busy on average during the run "
          f"(machine shared: read the ratios, not the absolute times). {harness.machine_line(args.threads)}")


if __name__ == "__main__":
    main()
