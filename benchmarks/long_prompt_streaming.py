"""A long prompt through the streaming cache (issue 10, case 16): time to the first new token.

SmolLM2-135M (embedded), a ~1,680-token prompt from the seed texts, n_ctx=256, n_keep=4. Compares
the shift policy's chunked prefill (the prompt goes through a copy of the ring with headroom)
with feeding the same prompt one token at a time (the old path), re-evaluate, and
``score(n_ctx=256)``; runs alternate, medians are printed with ratios. The first-token logits
of the two shift paths are compared too.

    python benchmarks/long_prompt_streaming.py [--tokens 1680] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fastdecode
from fastdecode.config import GenerationConfig
from fastdecode.generation.streaming import streaming_engine

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"


def first_logits(gen, ids, policy: str, one_by_one: bool = False):
    config = GenerationConfig.from_options(n_ctx=256, n_keep=4, policy=policy, max_new_tokens=None)
    engine = streaming_engine(gen.model, config)
    tokens = torch.tensor(ids)
    started = time.perf_counter()
    with torch.inference_mode():
        if one_by_one:  # the path before chunking: the full ring admits one token per forward
            for logits in engine._feed(tokens, all_logits=False):
                pass
            logits = logits[-1]
        else:
            logits = engine.feed(tokens)
    return time.perf_counter() - started, logits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1680)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--slow-reps", type=int, default=1, help="runs of the one-token-at-a-time path")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = fastdecode.load()
    text = " ".join(path.read_text() for path in sorted(SEEDS.glob("*.txt")))
    ids = gen.tokenizer.encode(text)[: args.tokens]
    with open("/proc/loadavg") as handle:
        print(f"prompt {len(ids)} tokens, n_ctx 256, 1 thread; load average {handle.read().split()[0]}")
    times = {"shift, chunked": [], "shift, one token at a time": [], "reevaluate": [], "score(n_ctx=256)": []}
    reference = None
    for rep in range(args.reps):
        seconds, chunked = first_logits(gen, ids, "shift")
        times["shift, chunked"].append(seconds)
        if rep < args.slow_reps:
            seconds, reference = first_logits(gen, ids, "shift", one_by_one=True)
            times["shift, one token at a time"].append(seconds)
        times["reevaluate"].append(first_logits(gen, ids, "reevaluate")[0])
        started = time.perf_counter()
        gen.score(ids, n_ctx=256, n_keep=4)
        times["score(n_ctx=256)"].append(time.perf_counter() - started)
    base = statistics.median(times["shift, chunked"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:30s} {median:7.2f} s  ({len(values)} runs)  {median / base:6.2f}x chunked shift")
    print(f"max |logits difference| chunked vs one by one: {(chunked - reference).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
