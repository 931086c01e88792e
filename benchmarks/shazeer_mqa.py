#!/usr/bin/env python
"""Shazeer (2019), "Fast Transformer Decoding: One Write-Head is All You Need", on this CPU.

The seed's claim: an incremental decoding step reloads every cached key and value, so at long
contexts that memory traffic (b * n * d per layer for multi-head attention) dominates the step, and
multi-query attention (one K/V head shared by all query heads) removes it (b * n * d / h).

Three random Llama models of the same shape (transformers configs, saved and loaded with
``fastdecode.load``): h query heads with h, h/4 and 1 KV heads (MHA, GQA, MQA). For each context
length, ``Generator.engine()`` prefills B prompts of that length, then its decode steps (every
sequence's next token, nothing else in the step) are timed; the three models alternate within
every repetition (A/B/C, A/B/C, ...) and medians are reported, so machine load drifts hit all alike.

    python benchmarks/shazeer_mqa.py            # contexts 128 .. 8192, batch 1 and 8 (the prefills take long)
    python benchmarks/shazeer_mqa.py --quick    # contexts 128 and 1024 only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness
from harness import median, table
from random_models import build_llama_block, saved_pair

HIDDEN, HEADS, LAYERS, VOCAB = 512, 8, 4, 8192


def decode_step_seconds(gen, batch: int, context: int, steps: int) -> float:
    """Median seconds of one decode step of ``batch`` sequences after ``context`` prompt tokens each."""
    prompts = [[(7 * row + 13 * i) % (VOCAB - 3) + 3 for i in range(context)] for row in range(batch)]
    engine = gen.engine(max_batch_tokens=2048, max_queue=batch, cache_tokens=batch * (context + steps + 2))
    for prompt in prompts:
        engine.submit(prompt, {"max_new_tokens": steps + 2, "eos_token_id": []})
    started_rows, times = set(), []
    while engine.has_work():
        decoding = len(started_rows) == batch  # every prompt is in the cache: this step only decodes
        began = time.perf_counter()
        events = engine.step()
        if decoding:
            times.append(time.perf_counter() - began)
        started_rows |= {event.sequence.id for event in events}
    return median(times[1:])  # the first decode step warms up


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="contexts 128 and 1024, fewer repetitions")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    parser.add_argument("--steps", type=int, default=5, help="timed decode steps per measurement (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = (128, 1024) if args.quick else (128, 512, 2048, 8192)
    reps = 1 if args.quick else args.reps
    kinds = {"MHA": HEADS, "GQA": HEADS // 4, "MQA": 1}
    results: dict[tuple[str, int, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        max_context = max(contexts) + 64
        models = {name: saved_pair(lambda kv=kv: build_llama_block(kv, LAYERS, HIDDEN, HEADS, VOCAB, max_context),
                                   Path(tmp) / name)[1] for name, kv in kinds.items()}
        for batch in (1, 8):
            for context in contexts:
                for rep in range(reps):
                    for name, gen in models.items():  # A/B/C within every repetition
                        seconds = decode_step_seconds(gen, batch, context, args.steps)
                        results.setdefault((name, batch, context), []).append(seconds)
                        print(f"  batch {batch} context {context:5d} rep {rep + 1} {name}: {seconds * 1e3:7.2f} ms",
                              file=sys.stderr)
        print(render({name: gen.inspect() for name, gen in models.items()}, kinds, contexts, results,
                     torch.get_num_threads()))


def render(info, kinds, contexts, results, threads: int) -> str:
    mha = info["MHA"]
    lines = [f"## Multi-query attention on this CPU (Shazeer 2019), {threads} threads, float32", "",
             harness.machine_line(threads), "",
             f"Random Llama models: {LAYERS} layers, hidden {HIDDEN}, {HEADS} query heads of {HIDDEN // HEADS}, "
             f"FFN {3 * HIDDEN}, vocabulary {VOCAB}; they differ only in K/V heads.", "",
             table(["model", "KV heads", "KV bytes / token", "weight bytes"],
                   [[name, kinds[name], f"{i['kv_cache_bytes_per_token']:,}", f"{i['weight_bytes']:,}"]
                    for name, i in info.items()])]
    names = list(info)
    for batch in (1, 8):
        rows = []
        for context in contexts:
            ms = {n: median(results[(n, batch, context)]) * 1e3 for n in names}
            kv_read = batch * context * mha["kv_cache_bytes_per_token"] / 2**20
            rows.append([context] + [f"{ms[n]:.2f}" for n in names] + [f"{ms['MHA'] / ms[n]:.2f}x" for n in names[1:]]
                        + [f"{kv_read:.0f} MiB"])
        first, last = contexts[0], contexts[-1]
        growth = {n: (median(results[(n, batch, last)]) - median(results[(n, batch, first)])) * 1e3 for n in names}
        lines += ["", f"Decode step time at batch {batch} (ms, median), and MHA / model:", "",
                  table(["context"] + names + [f"MHA/{n}" for n in names[1:]] + ["MHA KV read / step"], rows), "",
                  f"Step time added from context {first} to {last} (the K/V reload term): "
                  + ", ".join(f"{n} {growth[n]:+.2f} ms" for n in names) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
