#!/usr/bin/env python
"""Beam search speed, FastSeq-style: fastdecode vs transformers ``generate(num_beams=4)``.

Random-weight models of real sizes (speed does not depend on the weight values): a bart-base-sized
BART (6+6 layers, d_model 768, vocab 50265) over 8 sources of 256 tokens, and a gpt2-sized GPT-2
(124M config) over 8 prompts of 256 tokens. Beam 4, no_repeat_ngram_size 3, length_penalty 2.0,
48 new tokens (min_new_tokens = 48 so both engines do the same number of steps), float32 on CPU.

The engines alternate (A/B/A/B, harness.alternate) so drifting machine load hits both alike; medians
with min-max. The cost of no-repeat-n-gram blocking is timed inside the fastdecode runs (``NgramTimer``): the
n-gram ban ids and the token-history upkeep (``TokenSelector.record`` / ``select_rows`` of a selector
whose only per-row state is the history, as here). The difference of two whole-call medians (with
minus without blocking) measured it before: ~0.5 ms a step under noise of +-100 ms a call, it gave
anything from -2 to +3.5 ms a step.

K/V cache bytes after the run. fastdecode (FastSeq layout): the prompt (encoder-decoder: the
source's cross-attention K/V) is stored once per sample, the generated tokens once per beam. The
bytes per token come from ``Generator.inspect()``, times the tokens each part holds. transformers: every
tensor of the cache its ``generate`` returns, with every beam holding the whole prompt.

    python benchmarks/beam_speed.py            # several minutes on 2 shared cores
    python benchmarks/beam_speed.py --quick    # smoke run

Threads default to 1 (two OpenMP threads on a loaded 2-core machine thrash); ``--threads 2`` to try.
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
from random_models import build_bart, build_gpt2, random_ids, run_models, saved_pair

TARGET_SPEEDUP = 3.0
TARGET_NGRAM_SHARE = 0.02


@dataclass
class Settings:
    batch: int = 8
    prompt_length: int = 256
    new_tokens: int = 48
    beams: int = 4
    ngram: int = 3
    length_penalty: float = 2.0
    reps: int = 3
    threads: int = 1

    @classmethod
    def quick(cls) -> "Settings":
        return cls(batch=2, prompt_length=64, new_tokens=8, reps=1)


class NgramTimer:
    """Seconds spent on no-repeat-n-gram blocking inside fastdecode calls, while installed (a context
    manager): the ban ids (``NgramTable.ids`` on the CPU, else ``no_repeat_ngram_ids`` or the PyTorch step's
    ``no_repeat_ngram_mask``) and the history kept for them (``record`` / ``select_rows`` of selectors holding a history and no other
    per-row state, so that nothing else is counted)."""

    def __init__(self):
        self.seconds = 0.0
        self.saved: list = []

    def timed(self, fn, counts=lambda *args: True):
        def run(*args, **kwargs):
            if not counts(*args):
                return fn(*args, **kwargs)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return run

    def __enter__(self):
        from fastdecode.decoding import ngram_table, sampling

        def history_only(selector, *rest):
            return (selector.history is not None or selector.ngrams is not None) and all(
                getattr(selector, name) is None for name in ("seen", "counts", "generators", "grammar_states"))

        for owner, name, counts in ((sampling, "no_repeat_ngram_ids", None), (sampling, "no_repeat_ngram_mask", None),
                                    (ngram_table.NgramTable, "ids", None),
                                    (sampling.TokenSelector, "record", history_only),
                                    (sampling.TokenSelector, "select_rows", history_only)):
            fn = getattr(owner, name)
            self.saved.append((owner, name, fn))
            setattr(owner, name, self.timed(fn, counts) if counts else self.timed(fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)
        self.saved.clear()


def run_model(name: str, build, settings: Settings, folder: Path) -> dict:
    hf, gen = saved_pair(build, folder)
    prompts = random_ids(settings.batch, settings.prompt_length, hf.config.vocab_size)
    ids, mask = prompts.tolist(), torch.ones_like(prompts)
    options = dict(num_beams=settings.beams, no_repeat_ngram_size=settings.ngram,
                   length_penalty=settings.length_penalty, max_new_tokens=settings.new_tokens,
                   min_new_tokens=settings.new_tokens)
    start = 1 if hf.config.is_encoder_decoder else settings.prompt_length  # transformers' rows hold more

    their_cache = {}

    def theirs(batch=prompts, attention=mask, **extra):
        with torch.inference_mode():
            out = hf.generate(batch, attention_mask=attention, do_sample=False, return_dict_in_generate=True,
                              pad_token_id=hf.config.eos_token_id, **{**options, **extra})
        their_cache["bytes"] = tensor_bytes(out.past_key_values)
        return [row[start:].tolist() for row in out.sequences]

    print(f"## {name}: warm-up", flush=True, file=sys.stderr)
    gen.generate_ids(ids[:1], **{**options, "max_new_tokens": 2, "min_new_tokens": 2})
    theirs(prompts[:1], mask[:1], max_new_tokens=2, min_new_tokens=2)
    with NgramTimer() as ngram:
        times, outputs = harness.alternate({
            "fastdecode": lambda: gen.generate_ids(ids, **options),
            "transformers": theirs,
        }, settings.reps, name)
    same = sum(a == b[: len(a)] for a, b in zip(outputs["fastdecode"], outputs["transformers"]))
    fd, tf_ = median(times["fastdecode"]), median(times["transformers"])
    ngram_s = ngram.seconds / settings.reps  # per fastdecode call
    shared, per_beam = fastseq_cache_bytes(gen.inspect(), settings)
    return {"model": name, "fd": [settings.batch / s for s in times["fastdecode"]],
            "tf": [settings.batch / s for s in times["transformers"]], "speedup": tf_ / fd,
            "identical": f"{same}/{len(outputs['fastdecode'])}", "shared": shared, "per_beam": per_beam,
            "their_cache": their_cache["bytes"],
            "ngram_ms_per_step": 1000 * ngram_s / settings.new_tokens, "ngram_share": ngram_s / fd}


def fastseq_cache_bytes(info: dict, settings: Settings) -> tuple[int, int]:
    """(bytes stored once per sample, bytes stored per beam) of fastdecode's K/V after the run: the
    prompts (an encoder-decoder's sources, as cross-attention K/V) once, the new tokens per beam."""
    if "cross_attention_cache_bytes_per_source_token" in info:  # encoder-decoder
        once, generated = info["cross_attention_cache_bytes_per_source_token"], info["kv_cache_bytes_per_target_token"]
    else:
        once = generated = info["kv_cache_bytes_per_token"]
    return (once * settings.batch * settings.prompt_length,
            generated * settings.batch * settings.beams * settings.new_tokens)


def tensor_bytes(cache) -> int:
    """Bytes of every tensor in a transformers cache object (self-attention and cross-attention)."""
    total, seen = 0, set()

    def visit(obj, depth=0):
        nonlocal total
        if depth > 4 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            total += obj.nbytes
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
        elif hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                visit(item, depth + 1)

    visit(cache)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    parser.add_argument("--models", default="bart,gpt2", help="comma-separated: bart, gpt2")
    args = parser.parse_args()
    settings = Settings.quick() if args.quick else Settings()
    settings.threads = args.threads or settings.threads
    torch.set_num_threads(settings.threads)
    builders = {"bart-base size": build_bart, "gpt2 size": build_gpt2}
    started, meter = time.perf_counter(), harness.Contention()
    rows = run_models(builders, args.models, run_model, settings)

    print(f"\n# Beam search: {settings.batch} prompts x {settings.prompt_length} tokens, beam {settings.beams}, "
          f"no_repeat_ngram_size {settings.ngram}, length_penalty {settings.length_penalty}, "
          f"{settings.new_tokens} new tokens, float32, torch {torch.__version__}\n")
    print(harness.machine_line(settings.threads) + f"; other processes kept {meter.other_cores():.2f} cores busy\n")
    mib = 1 / 2**20
    print(harness.table(
        ["model", "transformers samples/s", "fastdecode samples/s", "speedup", "identical",
         "fastdecode K/V MiB (once per sample + per beam)", "transformers K/V MiB", "n-gram ms/step", "n-gram share"],
        [[r["model"], spread(r["tf"], 2), spread(r["fd"], 2), f"{r['speedup']:.2f}x", r["identical"],
          f"{r['shared'] * mib:.1f} + {r['per_beam'] * mib:.1f}", f"{r['their_cache'] * mib:.1f}",
          f"{r['ngram_ms_per_step']:.2f}", f"{100 * r['ngram_share']:.2f}%"] for r in rows]))
    print(f"\nsamples/s: median (min-max) over {settings.reps} alternating reps. n-gram: the time fastdecode's calls "
          f"spent on n-gram bans and the history they read, per call, over the median call.\nTargets: >= {TARGET_SPEEDUP:.0f}x transformers "
          f"samples/s; n-gram blocking < {100 * TARGET_NGRAM_SHARE:.0f}% of decode time.")
    for r in rows:
        speed = "meets" if r["speedup"] >= TARGET_SPEEDUP else "misses"
        ngram = "meets" if r["ngram_share"] < TARGET_NGRAM_SHARE else "misses"
        print(f"- {r['model']}: {r['speedup']:.2f}x ({speed} the speed target); n-gram blocking "
              f"{100 * r['ngram_share']:.2f}% ({ngram} its target)")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
