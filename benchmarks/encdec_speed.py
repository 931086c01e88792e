#!/usr/bin/env python
"""Encoder-decoder generation speed: fastdecode vs transformers ``generate`` vs the naive loop.

Random-weight models of real sizes (the speed of a forward does not depend on the weight values):
a bart-base-sized BART (6+6 layers, d_model 768, 12 heads, FFN 3072, vocab 50265) and a
t5-small-sized T5 (6+6, d_model 512, 8 heads, d_ff 2048, vocab 32128). Greedy decoding, float32 on
CPU, 8 sources of 256 tokens, 48 new tokens (EOS suppressed with min_new_tokens so every engine
does the same work). Every timed call includes the encoder, as a user's call does.

fastdecode loads the model the way a user does (``fastdecode.load`` of a saved folder: canonical
[in, out] weights); transformers runs the in-memory model it was saved from. The two alternate
(A/B/A/B...) so drifting machine load hits both alike; medians are reported. The naive loop
(``use_cache=False``: encoder and decoder re-run over everything at every step) re-encodes 8 x 256
tokens per step, so it gets a shorter run (``--naive-new-tokens``), compared with fastdecode's
cached loop on that same shorter run.

    python benchmarks/encdec_speed.py            # ~3 minutes on 2 shared cores
    python benchmarks/encdec_speed.py --quick    # smoke run (~1 minute)

Threads default to 1: on a shared 2-core machine, two OpenMP threads per process spend more time
spinning at barriers than computing (runs were 4-8x slower and erratic); ``--threads 2`` to try.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import fastdecode  # noqa: E402
from fastdecode.generation.encdec import right_pad  # noqa: E402
from random_models import build_bart, build_t5  # noqa: E402

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


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def run_model(name: str, build, settings: Settings, folder: Path) -> list[dict]:
    torch.manual_seed(0)
    hf = build().eval()
    hf.generation_config.forced_eos_token_id = None  # same work for every engine: no forced tokens
    hf.generation_config.forced_bos_token_id = None
    hf.save_pretrained(folder)
    gen = fastdecode.load(str(folder))
    vocab = hf.config.vocab_size
    sources = torch.randint(3, vocab - 1, (settings.batch, settings.source_length),
                            generator=torch.Generator().manual_seed(1))
    ids = sources.tolist()
    mask = torch.ones_like(sources)

    def ours(new_tokens: int, use_cache: bool = True):
        return gen.generate_ids(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=use_cache)

    def theirs(new_tokens: int):
        with torch.inference_mode():
            out = hf.generate(sources, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, num_beams=1, no_repeat_ngram_size=0)
        return [row[1:].tolist() for row in out]  # without the decoder start token

    print(f"## {name}: warm-up", file=sys.stderr, flush=True)
    ours(2), theirs(2)
    times: dict[str, list[float]] = {"fastdecode": [], "transformers": []}
    outputs = {}
    for rep in range(settings.reps):  # alternate A/B
        for engine, fn in (("fastdecode", ours), ("transformers", theirs)):
            seconds, outputs[engine] = timed(lambda: fn(settings.new_tokens))
            times[engine].append(seconds)
            print(f"  {name} {engine} rep {rep}: {seconds:.2f}s", file=sys.stderr, flush=True)
    same = sum(a == b for a, b in zip(outputs["fastdecode"], outputs["transformers"]))

    # The encoder alone (same 8 x S sources), to show where the time goes.
    tokens, valid, positions = right_pad(ids, gen.device)
    encoder: dict[str, list[float]] = {"fastdecode": [], "transformers": []}
    with torch.inference_mode():
        for rep in range(settings.reps):
            encoder["fastdecode"].append(timed(lambda: gen.model.encode(tokens, positions, valid))[0])
            encoder["transformers"].append(timed(lambda: hf.get_encoder()(input_ids=sources, attention_mask=mask))[0])

    short: dict[str, list[float]] = {"naive": [], "cached": []}
    for rep in range(settings.naive_reps):
        for engine, use_cache in (("naive", False), ("cached", True)):
            seconds, _ = timed(lambda: ours(settings.naive_new_tokens, use_cache))
            short[engine].append(seconds)
            print(f"  {name} {engine} ({settings.naive_new_tokens} tokens) rep {rep}: {seconds:.2f}s",
                  file=sys.stderr, flush=True)

    def row(engine, seconds, new_tokens, reference=None):
        median = statistics.median(seconds)
        return {"model": name, "engine": engine, "new_tokens": new_tokens, "seconds": median,
                "samples_per_s": settings.batch / median, "reps": len(seconds),
                "speedup": None if reference is None else statistics.median(reference) / median}

    return [
        row("transformers encoder forward only", encoder["transformers"], 0),
        row("fastdecode encoder forward only", encoder["fastdecode"], 0, encoder["transformers"]),
        row("transformers generate", times["transformers"], settings.new_tokens),
        row("fastdecode", times["fastdecode"], settings.new_tokens, times["transformers"])
        | {"identical": f"{same}/{settings.batch} targets identical"},
        row("fastdecode naive (use_cache=False)", short["naive"], settings.naive_new_tokens),
        row("fastdecode cached", short["cached"], settings.naive_new_tokens, short["naive"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    parser.add_argument("--models", default="bart,t5", help="comma-separated: bart, t5")
    args = parser.parse_args()
    settings = Settings.quick() if args.quick else Settings()
    if args.threads:
        settings.threads = args.threads
    torch.set_num_threads(settings.threads)
    builders = {"bart-base size": build_bart, "t5-small size": build_t5}
    chosen = {name: fn for name, fn in builders.items() if name.split("-")[0] in args.models.split(",")}

    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode(False):
        for index, (name, build) in enumerate(chosen.items()):
            rows += run_model(name, build, settings, Path(tmp) / str(index))

    print(f"\n# Encoder-decoder greedy generation, {settings.batch} sources x {settings.source_length} tokens, "
          f"float32, CPU ({platform.processor() or platform.machine()}, {settings.threads} thread(s), "
          f"torch {torch.__version__})\n")
    print("| model | engine | new tokens | median s | samples/s | speedup | reps | note |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        speedup = "" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"| {r['model']} | {r['engine']} | {r['new_tokens']} | {r['seconds']:.2f} | {r['samples_per_s']:.2f} | "
              f"{speedup} | {r['reps']} | {r.get('identical', '')} |")
    print("\nspeedup: fastdecode vs transformers (same run, alternating), and the cached loop vs the "
          f"naive loop on the shorter run. samples/s of the encoder rows: sources encoded per second. "
          f"Target vs transformers generate: >= {TARGET_SPEEDUP:.1f}x.")
    for r in rows:
        if r["engine"] == "fastdecode":
            verdict = "meets" if r["speedup"] >= TARGET_SPEEDUP else "misses"
            print(f"- {r['model']}: {r['speedup']:.2f}x transformers ({verdict} the {TARGET_SPEEDUP:.1f}x target)")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
