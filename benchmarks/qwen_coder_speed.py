"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the ``qwen`` extra's GGUF, joined by tests/qwen_coder.py):
load time, then greedy decode tokens/s at batch 1 and batch 8 on the native path (Q4_K / Q6_K blocks
kept, the int8-activation kernels).

    python benchmarks/qwen_coder_speed.py [--new-tokens 64] [--reps 2] [--threads 0]

Decode tokens/s counts generated tokens only, over the time after the first token (prompt and first
step excluded), median over the repetitions. llama.cpp is not run here: the issue's side-by-side needs
a ``llama-bench`` binary on the same machine (benchmarks/peers has the harness for one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

PROMPTS = ["def quicksort(items):\n", "# Read a CSV file and print the sum of its second column\n",
           "class LinkedList:\n", "SELECT customer_id, SUM(total) FROM", "// binary search in C\nint search(",
           "fn main() {\n", "#!/bin/bash\n# back up a folder\n", "import numpy as np\n\ndef softmax(x):\n"]


def decode_rate(gen, prompts: list[str], new_tokens: int, reps: int) -> float:
    """Generated tokens per second after the first token, median of ``reps`` runs."""
    rates = []
    for _ in range(reps):
        ids = [gen.tokenizer.encode(p) for p in prompts]
        start = time.perf_counter()
        gen.generate_ids(ids, max_new_tokens=1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        out = gen.generate_ids(ids, max_new_tokens=new_tokens)
        total = time.perf_counter() - start
        rates.append(sum(len(o) - 1 for o in out) / max(total - first, 1e-9))
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all CPUs)")
    args = parser.parse_args(argv)

    import torch

    import fastdecode
    from qwen_coder import qwen_coder_gguf

    if args.threads:
        torch.set_num_threads(args.threads)
    path = qwen_coder_gguf()
    start = time.perf_counter()
    gen = fastdecode.load(str(path))
    load_s = time.perf_counter() - start
    gen.generate_ids([gen.tokenizer.encode("warm up")], max_new_tokens=2)
    print(f"load {load_s:.2f} s  ({torch.get_num_threads()} threads)")
    for batch in (1, 8):
        rate = decode_rate(gen, PROMPTS[:batch], args.new_tokens, args.reps)
        print(f"batch {batch}: {rate:.1f} tok/s")


if __name__ == "__main__":
    main()
