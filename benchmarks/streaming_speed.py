"""Infinite (streaming) generation on the embedded model: speed stays flat, memory stays flat.

Generates ``--tokens`` tokens with a streaming cache (n_ctx=512, n_keep=4) under the shift and
re-evaluate policies, timing the first and last 1,000 tokens and sampling RSS; compares the
per-token latency with plain cached generation inside the context, and with a naive sliding
window that recomputes the whole window every step. Also scores the seed texts (~26k tokens)
(8192 tokens by default, --quality-tokens 30000 for all ~26k) with n_ctx=256 with and without
attention sinks (the StreamingLLM result).

    python benchmarks/streaming_speed.py            # full run (~10 min on 2 cores)
    python benchmarks/streaming_speed.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import time
from pathlib import Path

import torch

import fastdecode
import harness
from harness import table

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"


def rss_mib() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096 / 2**20


def timed_stream(gen, prompt_ids, total, marks, **options):
    """Stream ``total`` tokens; return {mark: (seconds since start, rss MiB)} at each mark."""
    stream = gen.stream_ids(prompt_ids, max_new_tokens=None, eos_token_id=[], **options)
    seen, start = {}, time.perf_counter()
    for count, _ in enumerate(stream, start=1):
        if count in marks:
            seen[count] = (time.perf_counter() - start, rss_mib())
        if count == total:
            break
    stream.close()
    return seen


def plain_latency(gen, prompt_ids, steps):
    """ms per token of plain cached generation inside the context (prefill excluded)."""
    def run(n):
        start = time.perf_counter()
        gen.generate_ids([prompt_ids], max_new_tokens=n, eos_token_id=[])
        return time.perf_counter() - start
    return (run(steps + 1) - run(1)) / steps * 1e3


def naive_window_latency(gen, prompt_ids, window, steps):
    """ms per token of a sliding window recomputed from scratch every step (no cache at all): each token
    is a 1-token ``use_cache=False`` generation over the last ``window`` tokens."""
    context = (prompt_ids * (window // len(prompt_ids) + 1))[:window]
    start = time.perf_counter()
    for _ in range(steps):
        context += gen.generate_ids([context[-window:]], max_new_tokens=1, eos_token_id=[], use_cache=False)[0]
    return (time.perf_counter() - start) / steps * 1e3


def sink_quality(gen, max_tokens):
    text = "\n\n".join(Path(p).read_text() for p in sorted(glob.glob(str(SEEDS / "*.txt"))))
    ids = gen.tokenizer.encode(text)[:max_tokens]
    context = gen.config.max_position_embeddings
    full = []  # "a cache large enough": whole segments of the model's full context
    for begin in range(0, len(ids) - 1, context):
        segment = ids[begin : begin + context + 1]
        if len(segment) > 1:
            full += gen.score(segment)
    rows = {"full context (segments of %d)" % context: full}
    for n_keep in (4, 0):
        start = time.perf_counter()
        rows[f"n_ctx=256, sinks={n_keep}, shift"] = gen.score(ids, n_ctx=256, n_keep=n_keep, policy="shift")
        print(f"  scored {len(ids)} tokens with {n_keep} sinks in {time.perf_counter() - start:.0f} s", flush=True)
    return len(ids), {name: sum(v) / len(v) for name, v in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quality-tokens", type=int, default=8192,
                        help="tokens of the seed texts to score (all of them: 30000)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    total = 600 if args.quick else args.tokens
    block = total // 4
    gen = fastdecode.load()
    prompt = gen.encode_prompt("Write a very long story about the sea.", chat=True)
    results = {}

    for policy in ("shift", "reevaluate"):
        marks = {block, total - block, total}
        seen = timed_stream(gen, prompt, total, marks, n_ctx=512, n_keep=4, policy=policy)
        first = block / seen[block][0]
        last = block / (seen[total][0] - seen[total - block][0])
        results[policy] = {"first_tps": first, "last_tps": last, "ms_per_token": seen[total][0] / total * 1e3,
                           "rss_first_mib": seen[block][1], "rss_last_mib": seen[total][1]}
        print(f"{policy}: {results[policy]}", flush=True)

    plain = plain_latency(gen, prompt, 60 if args.quick else 400)
    naive = naive_window_latency(gen, prompt, 512, 3 if args.quick else 10)
    quality_tokens, quality = sink_quality(gen, 3000 if args.quick else args.quality_tokens)

    shift_ms = 1e3 / results["shift"]["last_tps"]
    reeval_ms = results["reevaluate"]["ms_per_token"]
    print(f"\n## Streaming generation, {total} tokens, n_ctx=512, n_keep=4 "
          f"(embedded SmolLM2-135M, fp32)\n\n{harness.machine_line(args.threads)}\n")
    print(table(["policy", f"tok/s first {block}", f"tok/s last {block}", "ms/token overall",
                 f"RSS after first {block}", "RSS at end"],
                [[policy, f"{r['first_tps']:.1f}", f"{r['last_tps']:.1f}", f"{r['ms_per_token']:.1f}",
                  f"{r['rss_first_mib']:.0f} MiB", f"{r['rss_last_mib']:.0f} MiB"] for policy, r in results.items()]))
    print("\n" + table(["per-token latency", "ms", "vs plain"], [
        ["plain cached generation inside the context", f"{plain:.1f}", "1.00"],
        [f"shift, steady state (last {block}, cache full)", f"{shift_ms:.1f}", f"{shift_ms / plain:.2f}"],
        [f"re-evaluate, amortized over all {total}", f"{reeval_ms:.1f}", f"{reeval_ms / plain:.2f}"],
        ["naive sliding window (recompute 512 each step)", f"{naive:.1f}", f"{naive / plain:.2f}"]]))
    print(f"\nshift vs naive sliding window: {naive / shift_ms:.1f}x faster. "
          f"Target: shift <= 1.10x plain -> {'PASS' if shift_ms / plain <= 1.10 else 'FAIL'}")
    base = next(iter(quality.values()))
    print("\n" + table([f"scoring {quality_tokens} tokens of the seeds", "mean NLL", "perplexity", "vs full"],
                       [[name, f"{value:.4f}", f"{math.exp(value):.2f}", f"{value / base:.3f}"]
                        for name, value in quality.items()]))
    if args.json:
        args.json.write_text(json.dumps({"stream": results, "plain_ms": plain, "naive_ms": naive,
                                         "quality": quality}, indent=2))


if __name__ == "__main__":
    main()
