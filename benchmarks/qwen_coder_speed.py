"""Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the ``qwen`` extra's GGUF, joined by tests/qwen_coder.py):
load time, then greedy decode tokens/s at batch 1 and batch 8 on the native path (Q4_K / Q6_K blocks
kept, the int8-activation kernels), and prompt processing (a ``--prompt-tokens`` prompt and one new token)
with exact prompt rows (the default) and with int8 prompt rows (``quantized.PROMPT_ROWS_EXACT`` off: the
tiled kernel and the Q6_K prompt GEMM, layers/qprompt.cpp), alternating, medians.

    python benchmarks/qwen_coder_speed.py [--new-tokens 64] [--reps 2] [--threads 0]
    python benchmarks/qwen_coder_speed.py --llama-cpp-bin DIR --threads 2   # side by side with llama-server

Decode tokens/s counts generated tokens only, over the time after the first token (prompt and first
step excluded), median over the repetitions. With ``--llama-cpp-bin`` (llama.cpp's binaries, built by
benchmarks/peers/build_llama_cpp.sh) the same jobs also run on llama-server (8 slots, continuous
batching) on the same file, alternating with fastdecode in every repetition: whole jobs (the prompts
and exactly ``--new-tokens`` greedy tokens each, EOS ignored) timed end to end, and the ratio.
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


def prompt_rates(gen, tokens: int, reps: int) -> dict[str, float]:
    """Prompt tokens per second (the prompt and one new token), exact and int8 prompt rows alternating,
    medians of ``reps``; the prompt is this file's text, repeated to ``tokens`` tokens."""
    from fastdecode.layers import quantized

    ids = gen.tokenizer.encode(Path(__file__).read_text())
    ids = (ids * (tokens // len(ids) + 1))[:tokens]
    seconds: dict[str, list[float]] = {"exact": [], "int8": []}
    try:
        for _ in range(reps):
            for mode, times in seconds.items():
                quantized.PROMPT_ROWS_EXACT = mode == "exact"
                start = time.perf_counter()
                gen.generate_ids([ids], max_new_tokens=1)
                times.append(time.perf_counter() - start)
    finally:
        quantized.PROMPT_ROWS_EXACT = True
    return {mode: tokens / statistics.median(times) for mode, times in seconds.items()}


def side_by_side(gen, path, bin_dir: str, threads: int, new_tokens: int, reps: int) -> None:
    """fastdecode and llama-server on the same whole jobs, alternating; a markdown table."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import harness
    from peers.llama_cpp import ServerPeer, find_binary

    binary, missing = find_binary("llama-server", Path(bin_dir))
    if binary is None:
        raise SystemExit(missing)
    prompts = [gen.tokenizer.encode(p) for p in PROMPTS]
    peer = ServerPeer(binary, path, threads, prompts[0])
    try:
        rows = []
        for batch in (1, 8):
            jobs = prompts[:batch]
            calls = {"fastdecode": lambda: gen.generate_ids(jobs, max_new_tokens=new_tokens,
                                                            min_new_tokens=new_tokens),
                     "llama.cpp": lambda: peer.call("generate", jobs, new_tokens)}
            times, _ = harness.alternate(calls, reps, f"batch {batch}")
            ours, theirs = harness.median(times["fastdecode"]), harness.median(times["llama.cpp"])
            tokens = batch * new_tokens
            rows.append([f"batch {batch}, {new_tokens} new tokens", f"{tokens / ours:.1f}", f"{tokens / theirs:.1f}",
                         harness.fmt_ratio(theirs / ours)])
        print(f"llama-server ready {peer.ready['load_s']:.2f} s after its start, RSS {peer.ready['rss_kib'] / 1024:.0f} MB")
        print(harness.table(["job (whole, prompt included)", "fastdecode tok/s", "llama.cpp tok/s",
                             "fastdecode / llama.cpp"], rows))
    finally:
        peer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all CPUs)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--llama-cpp-bin", default=None, help="llama.cpp's binaries: also run llama-server")
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
    rates = prompt_rates(gen, args.prompt_tokens, args.reps)
    print(f"prompt {args.prompt_tokens}: exact prompt rows {rates['exact']:.1f} tok/s, int8 prompt rows "
          f"{rates['int8']:.1f} tok/s ({rates['int8'] / rates['exact']:.2f}x)")
    if args.llama_cpp_bin:
        side_by_side(gen, path, args.llama_cpp_bin, args.threads or torch.get_num_threads(), args.new_tokens,
                     args.reps)


if __name__ == "__main__":
    main()
