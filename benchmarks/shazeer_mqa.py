#!/usr/bin/env python
"""Shazeer (2019), "Fast Transformer Decoding: One Write-Head is All You Need", on this CPU.

The seed's claim: an incremental decoding step reloads every cached key and value, so at long
contexts that memory traffic (b * n * d per layer for multi-head attention) dominates the step, and
multi-query attention (one K/V head shared by all query heads) removes it (b * n * d / h).

Three random models of the same shape, built here with fastdecode's Llama block (no checkpoint):
h query heads with h, h/4 and 1 KV heads (MHA, GQA, MQA). For each context length the cache is
filled with random K/V up to that length (decode timing does not depend on their values) and
decode steps are timed through fastdecode's CachedEngine; the three models alternate within every
repetition (A/B/C, A/B/C, ...) and medians are reported, so machine load drifts hit all alike.

    python benchmarks/shazeer_mqa.py            # contexts 128 .. 8192, batch 1 and 8
    python benchmarks/shazeer_mqa.py --quick    # contexts 128 and 1024 only
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from fastdecode.config import ModelConfig
from fastdecode.generation.step import CachedEngine
from fastdecode.models.llama import LlamaModel

HIDDEN, HEADS, HEAD_DIM, LAYERS, FFN, VOCAB = 512, 8, 64, 4, 1536, 8192


def build(num_kv_heads: int) -> LlamaModel:
    """A random Llama-block model; only the number of K/V heads differs between the three."""
    config = ModelConfig(family="llama", architecture=f"random-{num_kv_heads}kv", vocab_size=VOCAB,
                         hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=num_kv_heads,
                         head_dim=HEAD_DIM, intermediate_size=FFN, max_position_embeddings=1 << 20)
    generator = torch.Generator().manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    kv = num_kv_heads * HEAD_DIM
    weights = {"embed.weight": weight(VOCAB, HIDDEN), "norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": weight(HIDDEN, VOCAB)}  # canonical linear layout: [in, out]
    for i in range(LAYERS):
        shapes = {"q": (HIDDEN, HEADS * HEAD_DIM), "k": (HIDDEN, kv), "v": (HIDDEN, kv), "o": (HEADS * HEAD_DIM, HIDDEN),
                  "gate": (HIDDEN, FFN), "up": (HIDDEN, FFN), "down": (FFN, HIDDEN)}
        weights |= {f"layers.{i}.{name}.weight": weight(*shape) for name, shape in shapes.items()}
        weights |= {f"layers.{i}.attn_norm.weight": torch.ones(HIDDEN), f"layers.{i}.mlp_norm.weight": torch.ones(HIDDEN)}
    return LlamaModel(config, weights)


def filled_engine(model: LlamaModel, batch: int, context: int, steps: int) -> CachedEngine:
    """An engine whose cache already holds ``context`` tokens per row (random K/V), room for ``steps`` more."""
    engine = CachedEngine(model, batch, context + steps)
    cache = engine.cache
    cache.keys[:, :, :, :context].normal_()
    cache.values[:, :, :, :context].normal_()
    cache.valid[:, :context] = True
    cache.positions[:, :context] = torch.arange(context)
    cache.length = context
    return engine


def step_seconds(model: LlamaModel, batch: int, context: int, steps: int) -> float:
    """Median seconds of one decode step (all rows) after ``context`` cached tokens."""
    engine = filled_engine(model, batch, context, steps + 1)
    tokens = torch.full((batch,), 5, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for step in range(steps + 1):
            positions = torch.full((batch,), context + step, dtype=torch.long)
            started = time.perf_counter()
            engine.decode(tokens, positions)
            times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first step warms up


def weight_bytes(model: LlamaModel) -> int:
    tensors = [model.embed, model.lm_head] + [t for layer in model.layers for t in vars(layer).values()
                                              if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors}.values())


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
    models = {name: build(kv) for name, kv in kinds.items()}
    results: dict[tuple[str, int, int], list[float]] = {}
    for batch in (1, 8):
        for context in contexts:
            for rep in range(reps):
                for name, model in models.items():  # A/B/C within every repetition
                    seconds = step_seconds(model, batch, context, args.steps)
                    results.setdefault((name, batch, context), []).append(seconds)
                    print(f"  batch {batch} context {context:5d} rep {rep + 1} {name}: {seconds * 1e3:7.2f} ms",
                          file=sys.stderr)
    print(render(models, kinds, contexts, results, torch.get_num_threads()))


def render(models, kinds, contexts, results, threads: int) -> str:
    mha = models["MHA"].config
    lines = [f"## Multi-query attention on this CPU (Shazeer 2019), {threads} threads, float32",
             "", f"Random Llama-block models: {mha.num_layers} layers, hidden {mha.hidden_size}, {mha.num_heads} query "
             f"heads of {mha.head_dim}, FFN {mha.intermediate_size}, vocabulary {mha.vocab_size}; they differ only in K/V heads.",
             "", "| model | KV heads | KV bytes / token | weight bytes |", "|---|---|---|---|"]
    for name, model in models.items():
        lines.append(f"| {name} | {kinds[name]} | {model.config.kv_cache_bytes_per_token():,} | {weight_bytes(model):,} |")
    for batch in (1, 8):
        lines += ["", f"Decode step time at batch {batch} (ms, median), and MHA / model:", "",
                  "| context | " + " | ".join(models) + " | " + " | ".join(f"MHA/{n}" for n in list(models)[1:])
                  + " | MHA KV read / step |", "|---" * (2 * len(models)) + "|---|"]
        for context in contexts:
            ms = {n: statistics.median(results[(n, batch, context)]) * 1e3 for n in models}
            kv_read = batch * context * mha.kv_cache_bytes_per_token() / 2**20
            lines.append(f"| {context} | " + " | ".join(f"{ms[n]:.2f}" for n in models) + " | "
                         + " | ".join(f"{ms['MHA'] / ms[n]:.2f}x" for n in list(models)[1:]) + f" | {kv_read:.0f} MiB |")
        first, last = contexts[0], contexts[-1]
        growth = {n: (statistics.median(results[(n, batch, last)]) - statistics.median(results[(n, batch, first)]))
                  * 1e3 for n in models}
        lines.append("")
        lines.append(f"Step time added from context {first} to {last} (the K/V reload term): "
                     + ", ".join(f"{n} {growth[n]:+.2f} ms" for n in models) + ".")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
