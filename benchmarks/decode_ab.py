#!/usr/bin/env python
"""Batch-1 greedy decoding of one GGUF, two source trees alternating (e.g. a branch against main).

Each repetition starts one fresh process per tree (in alternating order, so drift in machine load hits
both alike), each with its tree's ``src`` first on PYTHONPATH: it loads the model (native kernels, the
weight cache as a later load finds it, a folder per tree: the first load of each, untimed, writes its entry), decodes
``--new-tokens`` greedily once to warm up, then once timed. Reported per tree, medians with the min-max
range: tokens/s (wall), the process's CPU seconds per token (every thread: robust to other processes'
use of the cores, not to their use of the memory bus), peak resident memory (``ru_maxrss``), load time,
and the weight bytes one token reads (the blocks' matrices and the logits layer, as held). The trees'
generated tokens are compared: a change meant to give the same bits must give the same tokens.

    python benchmarks/decode_ab.py --baseline-src /work/main/src [--src src] [--model GGUF] \\
        [--threads 2] [--new-tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import harness

HERE = Path(__file__).resolve().parent
PROMPT = "def quicksort(items):\n"
QWEN = Path.home() / ".cache" / "fastdecode" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every block's matrices, bytes of the logits layer) one token reads, as held."""
    from fastdecode.layers.quantized import QuantizedWeight

    def size(weight) -> int:
        if isinstance(weight, QuantizedWeight):
            return weight.nbytes
        return weight.numel() * weight.element_size()

    blocks = sum(size(w) for layer in model.layers
                 for w in [*(part[0] for part in layer.qkv.parts), layer.o, *(part[0] for part in layer.gate_up.parts),
                           layer.down])
    return blocks, size(model.lm_head)


def worker(model: str, threads: int, new_tokens: int) -> None:
    """One tree's process: load, warm up, one timed decode; a JSON line on stdout."""
    start = time.perf_counter()
    import torch

    import fastdecode

    torch.set_num_threads(threads)
    gen = fastdecode.load(model)
    load_s = time.perf_counter() - start
    prompt = gen.tokenizer.encode(PROMPT)
    gen.generate_ids([prompt], max_new_tokens=new_tokens, eos_token_id=[])
    cpu = time.process_time()
    wall = time.perf_counter()
    tokens = gen.generate_ids([prompt], max_new_tokens=new_tokens, eos_token_id=[])
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    blocks, logits = weight_bytes(gen.model)
    print(json.dumps({"tok_s": new_tokens / wall, "cpu_ms_per_token": cpu / new_tokens * 1e3, "load_s": load_s,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "blocks_mb": blocks / 1e6, "logits_mb": logits / 1e6, "tokens": [list(t) for t in tokens],
                      "source": fastdecode.__file__}))


def run(side: str, src: str, args) -> dict:
    # each tree its own weight cache folder: one entry per GGUF path is kept, so trees sharing one would
    # evict each other's entry and repack at every load
    cache = Path(args.weight_cache) / side
    env = harness.quiet_env(PYTHONPATH=f"{src}:{HERE}", FASTDECODE_WEIGHT_CACHE=str(cache))
    command = [sys.executable, __file__, "--worker", "--model", args.model, "--threads", str(args.threads),
               "--new-tokens", str(args.new_tokens)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"{src}: worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-src", help="src/ folder of the baseline tree (e.g. main's); required")
    parser.add_argument("--src", default=str(HERE.parent / "src"), help="src/ folder of the tree measured")
    parser.add_argument("--model", default=str(QWEN), help="a GGUF file (default: Qwen2.5-Coder-1.5B Q4_K_M)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--weight-cache", default=str(Path.home() / ".cache" / "fastdecode" / "decode-ab"),
                        help="folder of the trees' weight caches (a subfolder each)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.threads, args.new_tokens)
        return
    if args.baseline_src is None:
        parser.error("--baseline-src is required")
    sides = {"baseline": os.path.abspath(args.baseline_src), "tree": os.path.abspath(args.src)}
    for side, src in sides.items():  # untimed: builds the kernels and writes the weight cache where missing
        run(side, src, args)
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for rep in range(args.reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for side in order:
            results[side].append(run(side, sides[side], args))
    print(harness.machine_line(args.threads))
    print(f"load average after: {os.getloadavg()[0]:.2f}, {os.getloadavg()[1]:.2f}, {os.getloadavg()[2]:.2f}; "
          f"{args.reps} reps, {args.new_tokens} new tokens, batch 1, {args.threads} threads, {Path(args.model).name}")
    rows = []
    for side, src in sides.items():
        got = results[side]
        first = got[0]
        rows.append([side, src, harness.spread([r["tok_s"] for r in got]),
                     harness.spread([r["cpu_ms_per_token"] for r in got]),
                     harness.spread([r["peak_rss_mb"] for r in got], 0), harness.spread([r["load_s"] for r in got]),
                     f"{first['blocks_mb']:.0f} + {first['logits_mb']:.0f}"])
    print(harness.table(["tree", "src", "tok/s (wall)", "CPU ms / token", "peak RSS MB", "load s",
                         "weights MB / token (blocks + logits)"], rows))
    base = results["baseline"][0]["tokens"]
    differing = [(side, r["tokens"]) for side in sides for r in results[side] if r["tokens"] != base]
    print("generated tokens: " + ("identical in every run" if not differing
                                  else "DIFFER\n" + "\n".join(f"  {side} {tokens}" for side, tokens in [("baseline", base), *differing])))


if __name__ == "__main__":
    main()
