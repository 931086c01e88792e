#!/usr/bin/env python
"""Where a batch-1 greedy decode step's time goes on a quantized Llama-family model (issue 29).

One ``generate_ids`` call of ``--new-tokens`` tokens per repetition (the embedded SmolLM2-135M Q4_1 by
default, or ``--model`` a GGUF), with timers around the engine step, the model forward, the blocks'
C++ op (``decode_stack`` or the per-block ``decode_block``), the logits layer, the embedding, the RoPE
tables and the sampler: what is left of the forward and of the step is Python. Next to it, the bytes
every token reads (the blocks' and the logits layer's weights) and the time they take at the measured
read bandwidth (harness.bandwidth, same thread count): the step's floor.

Timers: thread CPU time at 1 thread (the forward runs on the calling thread; robust to a busy machine's
other processes, not to their use of the memory bus), wall time at more (helpers work beside it).

    python benchmarks/decode_step_profile.py [--threads 1,2] [--new-tokens 64] [--reps 4] [--model GGUF]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

import harness

PROMPT = "def quicksort(items):\n"


def weight_bytes(model) -> tuple[int, int]:
    """(bytes of every block's matrices, bytes of the logits layer) one token reads."""
    from fastdecode.layers.quantized import QuantizedWeight

    def size(weight) -> int:
        if isinstance(weight, QuantizedWeight):
            return sum(t.numel() * t.element_size() for t in (weight.codes, weight.scale, weight.mins) if t is not None)
        return weight.numel() * weight.element_size()

    blocks = sum(size(w) for layer in model.layers
                 for w in [*(part[0] for part in layer.qkv.parts), layer.o, *(part[0] for part in layer.gate_up.parts),
                           layer.down])
    return blocks, size(model.lm_head)


def profile(gen, threads: int, new_tokens: int, reps: int) -> dict[str, float]:
    """Milliseconds per token of each timed part (``step`` the whole engine step)."""
    from fastdecode.engine.core import Engine
    from fastdecode.engine.sampler import Sampler
    from fastdecode.layers import ops, positions
    from fastdecode.models import llama

    clock = time.thread_time if threads == 1 else time.perf_counter
    spent: collections.Counter = collections.Counter()
    patches = []

    def timed(owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timing(call):
            def wrapper(*args, **kwargs):
                start = clock()
                try:
                    return call(*args, **kwargs)
                finally:
                    spent[label] += clock() - start

            return wrapper

        wrapper = timing(original)
        if hasattr(original, "_op"):  # an op overload that layers/ops.py may call through its C++ entry point
            wrapper._op = timing(original._op)
        patches.append((owner, name, original))
        setattr(owner, name, wrapper)

    kernels = ops._ops()
    timed(Engine, "step", "step")
    timed(llama.LlamaModel, "forward", "forward")
    timed(llama.LlamaModel, "head", "logits layer")
    timed(kernels, "decode_stack", "blocks (C++)")
    timed(kernels, "decode_block", "blocks (C++)")
    timed(llama, "embed", "embedding row")
    timed(positions.RotaryEmbedding, "tables", "RoPE tables")
    timed(Sampler, "sample", "sampler")
    torch.set_num_threads(threads)
    prompt = gen.tokenizer.encode(PROMPT)
    try:
        gen.generate_ids([prompt], max_new_tokens=4, eos_token_id=[])
        spent.clear()
        for _ in range(reps):
            gen.generate_ids([prompt], max_new_tokens=new_tokens, eos_token_id=[])
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
    tokens = reps * new_tokens
    parts = {label: seconds / tokens * 1e3 for label, seconds in spent.items()}
    inside = sum(parts.get(k, 0.0) for k in ("blocks (C++)", "logits layer", "embedding row", "RoPE tables"))
    parts["forward's Python"] = parts["forward"] - inside
    parts["engine's Python"] = parts["step"] - parts["forward"] - parts.get("sampler", 0.0)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--model", default="", help="a GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    args = parser.parse_args()
    import fastdecode

    gen = fastdecode.load(args.model or None)
    blocks, logits = weight_bytes(gen.model)
    print(f"weights read per token: blocks {blocks / 1e6:.1f} MB + logits layer {logits / 1e6:.1f} MB")
    for threads in (int(t) for t in args.threads.split(",")):
        bandwidth = harness.measure_bandwidth(threads)["sum"]
        parts = profile(gen, threads, args.new_tokens, args.reps)
        floor = (blocks + logits) / (bandwidth * 1e9) * 1e3
        clock = "thread CPU" if threads == 1 else "wall"
        print(f"\n{harness.machine_line(threads)}")
        print(f"{threads} thread(s), {clock} ms per token (read bandwidth {bandwidth:.1f} GB/s: "
              f"weights alone {floor:.2f} ms, blocks {blocks / (bandwidth * 1e6):.2f}, logits {logits / (bandwidth * 1e6):.2f})")
        for label in ("step", "forward", "blocks (C++)", "logits layer", "embedding row", "RoPE tables",
                      "forward's Python", "sampler", "engine's Python"):
            print(f"  {label:18s} {parts.get(label, 0.0):7.3f}")


if __name__ == "__main__":
    main()
