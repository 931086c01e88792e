#!/usr/bin/env python
"""Encoder-decoder generation speed: fastdecode vs transformers ``generate`` vs the naive loop.

Random-weight models of real sizes (the speed of a forward does not depend on the weight values):
a bart-base-sized BART (6+6 layers, d_model 768, 12 heads, FFN 3072, vocab 50265) and a
t5-small-sized T5 (6+6, d_model 512, 8 heads, d_ff 2048, vocab 32128). Greedy decoding, float32 on
CPU, 8 sources of 256 tokens, 48 new tokens (EOS suppressed with min_new_tokens so every engine
does the same work). Every timed call includes the encoder, as a user's call does.

fastdecode loads the model the way a user does (``fastdecode.load`` of a saved folder); transformers
runs the in-memory model it was saved from. They alternate (harness.alternate); medians with min-max.
Where the time goes: the encoder alone (one forward over the same sources: fastdecode's
``Generator.model.encode``, transformers' ``get_encoder()``), and both engines generating 1 token (the
encoder plus one decoder step). The naive
loop (``use_cache=False``: encoder and decoder re-run over everything at every step) re-encodes
8 x 256 tokens per step, so it gets a shorter run (``--naive-new-tokens``), compared with fastdecode's
cached loop on that same shorter run.

    python benchmarks/encdec_speed.py            # ~3 minutes on 2 shared cores
    python benchmarks/encdec_speed.py --quick    # smoke run (~1 minute)

Threads default to 1: on a shared 2-core machine, two OpenMP threads per process spend more time
spinning at barriers than computing (runs were 4-8x slower and erratic); ``--threads 2`` to try.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import harness
from harness import median, spread
from random_models import build_bart, build_t5, random_ids, run_models, saved_pair

TARGET_SPEEDUP = 2.0


@dataclass
class Settings:
    batch: int = 8
    source_length: int = 256
    new_tokens: int = 48
    reps: int = 3
    naive_new_tokens: int = 8
    naive_reps: int = 2
    threads: int = 1

    @classmethod
    def quick(cls) -> "Settings":
        return cls(source_length=64, new_tokens=16, reps=2, naive_new_tokens=4, naive_reps=1)


def run_model(name: str, build, settings: Settings, folder: Path) -> list[list[str]]:
    hf, gen = saved_pair(build, folder)
    sources = random_ids(settings.batch, settings.source_length, hf.config.vocab_size)
    ids, mask = sources.tolist(), torch.ones_like(sources)

    def ours(new_tokens: int, use_cache: bool = True):
        return gen.generate_ids(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=use_cache)

    def theirs(new_tokens: int):
        with torch.inference_mode():
            out = hf.generate(sources, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, num_beams=1, no_repeat_ngram_size=0)
        return [row[1:].tolist() for row in out]  # without the decoder start token

    print(f"## {name}: warm-up", file=sys.stderr, flush=True)
    ours(2), theirs(2)
    full, outputs = harness.alternate({"transformers generate": lambda: theirs(settings.new_tokens),
                                       "fastdecode": lambda: ours(settings.new_tokens)}, settings.reps, name)
    same = sum(a == b for a, b in zip(outputs["fastdecode"], outputs["transformers generate"]))
    tokens = torch.tensor(ids, device=gen.device)  # [B, S]: equal lengths, nothing to pad
    valid, positions = torch.ones_like(tokens, dtype=torch.bool), torch.arange(tokens.shape[1], device=gen.device)[None]

    def encode_ours():
        with torch.inference_mode():
            try:
                from fastdecode.layers.products import Products
            except ImportError:  # an older tree: row roles were a context variable
                return gen.model.encode(tokens, positions, valid)  # [B, S, C]
            kernels = getattr(gen.model, "kernels", None)  # None: an older tree, no kernel choice in products
            products = (Products.prompt(torch.get_num_threads()) if kernels is None
                        else Products.prompt(torch.get_num_threads(), kernels=kernels))
            return gen.model.encode(tokens, positions, valid, products=products)

    def encode_theirs():
        with torch.inference_mode():
            return hf.get_encoder()(input_ids=sources, attention_mask=mask)

    encoder, _ = harness.alternate({"transformers encoder forward only": encode_theirs,
                                    "fastdecode encoder forward only": encode_ours}, settings.reps, name)
    first, _ = harness.alternate({"transformers, 1 token (encoder + 1 step)": lambda: theirs(1),
                                  "fastdecode, 1 token (encoder + 1 step)": lambda: ours(1)}, settings.reps, name)
    naive, _ = harness.alternate({"fastdecode naive (use_cache=False)": lambda: ours(settings.naive_new_tokens, False),
                                  "fastdecode cached": lambda: ours(settings.naive_new_tokens)},
                                 settings.naive_reps, name)

    def rows(times: dict[str, list[float]], new_tokens: int, note: str = "") -> list[list[str]]:
        (base_name, base), (engine, seconds) = times.items()
        return [[name, label, str(new_tokens), spread(s, 2), spread([settings.batch / x for x in s], 2), speedup,
                 str(len(s)), text]
                for label, s, speedup, text in ((base_name, base, "", ""),
                                                (engine, seconds, f"{median(base) / median(seconds):.2f}x", note))]

    return (rows(encoder, 0) + rows(first, 1)
            + rows(full, settings.new_tokens, f"{same}/{settings.batch} targets identical")
            + rows(naive, settings.naive_new_tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    parser.add_argument("--models", default="bart,t5", help="comma-separated: bart, t5")
    args = parser.parse_args()
    settings = Settings.quick() if args.quick else Settings()
    settings.threads = args.threads or settings.threads
    torch.set_num_threads(settings.threads)
    builders = {"bart-base size": build_bart, "t5-small size": build_t5}
    started, meter = time.perf_counter(), harness.Contention()
    rows = [row for model_rows in run_models(builders, args.models, run_model, settings) for row in model_rows]

    print(f"\n# Encoder-decoder greedy generation, {settings.batch} sources x {settings.source_length} tokens, "
          f"float32, torch {torch.__version__}\n")
    print(harness.machine_line(settings.threads) + f"; other processes kept {meter.other_cores():.2f} cores busy\n")
    print(harness.table(["model", "engine", "new tokens", "seconds", "samples/s", "speedup", "reps", "note"], rows))
    print("\nseconds, samples/s: median (min-max) over alternating reps. speedup: the second row of each pair vs "
          f"the first (fastdecode vs transformers; the cached loop vs the naive loop on the shorter run). "
          "samples/s of the encoder rows (new tokens 0): sources encoded per second. "
          f"Target vs transformers generate: >= {TARGET_SPEEDUP:.1f}x.")
    for row in rows:
        if row[1] == "fastdecode":
            value = float(row[5].rstrip("x"))
            verdict = "meets" if value >= TARGET_SPEEDUP else "misses"
            print(f"- {row[0]}: {row[5]} transformers ({verdict} the {TARGET_SPEEDUP:.1f}x target)")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
