#!/usr/bin/env python
"""Beam search speed, FastSeq-style: fastdecode vs transformers ``generate(num_beams=4)``.

Random-weight models of real sizes (speed does not depend on the weight values): a bart-base-sized
BART (6+6 layers, d_model 768, vocab 50265) over 8 sources of 256 tokens, and a gpt2-sized GPT-2
(124M config) over 8 prompts of 256 tokens. Beam 4, no_repeat_ngram_size 3, length_penalty 2.0,
48 new tokens (min_new_tokens = 48 so both engines do the same number of steps), float32 on CPU.

The two engines alternate (A/B/A/B) so drifting machine load hits both alike; medians are reported.
Columns: samples/s (prompts per second, all beams included), K/V cache bytes after the run (fastdecode:
stored once per sample + stored per beam; transformers: its returned cache, every beam holding the
whole prompt), the process's peak RSS so far (ru_maxrss: not per engine, only an upper bound), and
the time spent in no-repeat-n-gram blocking (an instrumented separate run; share of its decode time).

    python benchmarks/beam_speed.py            # several minutes on 2 shared cores
    python benchmarks/beam_speed.py --quick    # smoke run

Threads default to 1 (two OpenMP threads on a loaded 2-core machine thrash); ``--threads 2`` to try.
"""

from __future__ import annotations

import argparse
import platform
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import fastdecode  # noqa: E402
from fastdecode.config import GenerationConfig  # noqa: E402
from fastdecode.generation import sampling  # noqa: E402
from fastdecode.generation.beam import BeamSearch  # noqa: E402
from random_models import build_bart, build_gpt2  # noqa: E402

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


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_model(name: str, build, settings: Settings, folder: Path) -> dict:
    torch.manual_seed(0)
    hf = build().eval()
    hf.generation_config.forced_eos_token_id = None  # same work for both engines: no forced tokens
    hf.generation_config.forced_bos_token_id = None
    hf.save_pretrained(folder)
    gen = fastdecode.load(str(folder))
    encdec = hf.config.is_encoder_decoder
    vocab = hf.config.vocab_size
    prompts = torch.randint(3, vocab - 1, (settings.batch, settings.prompt_length),
                            generator=torch.Generator().manual_seed(1))
    ids = prompts.tolist()
    mask = torch.ones_like(prompts)
    options = dict(num_beams=settings.beams, no_repeat_ngram_size=settings.ngram,
                   length_penalty=settings.length_penalty, max_new_tokens=settings.new_tokens,
                   min_new_tokens=settings.new_tokens)
    config = GenerationConfig.from_options(**options)
    eos = gen._eos_ids(config)

    def ours():
        search = BeamSearch(gen.model, ids, config, eos)
        return search, [r.tokens for r in search.run()]

    def theirs():
        with torch.inference_mode():
            out = hf.generate(prompts, attention_mask=mask, do_sample=False, return_dict_in_generate=True,
                              pad_token_id=hf.config.eos_token_id, **options)
        start = 1 if encdec else settings.prompt_length
        return out, [row[start:].tolist() for row in out.sequences]

    print(f"## {name}: warm-up", file=sys.stderr, flush=True)
    warm = GenerationConfig.from_options(config, max_new_tokens=2, min_new_tokens=2)
    BeamSearch(gen.model, ids[:1], warm, eos).run()
    with torch.inference_mode():
        hf.generate(prompts[:1], attention_mask=mask[:1], max_new_tokens=2, num_beams=settings.beams)
    times: dict[str, list[float]] = {"fastdecode": [], "transformers": []}
    outputs, handles = {}, {}
    for rep in range(settings.reps):  # alternate A/B
        for engine, fn in (("fastdecode", ours), ("transformers", theirs)):
            seconds, (handles[engine], outputs[engine]) = timed(fn)
            times[engine].append(seconds)
            print(f"  {name} {engine} rep {rep}: {seconds:.2f}s", file=sys.stderr, flush=True)
    same = sum(a == b[: len(a)] for a, b in zip(outputs["fastdecode"], outputs["transformers"]))
    shared, per_beam = handles["fastdecode"].cache_bytes()
    their_cache = _hf_cache_bytes(handles["transformers"].past_key_values)

    # n-gram blocking, instrumented: wrap the kernel the selector calls, in a separate run.
    spent = []
    kernel = sampling.no_repeat_ngram_mask

    def timed_kernel(*args):
        started = time.perf_counter()
        banned = kernel(*args)
        spent.append(time.perf_counter() - started)
        return banned

    sampling.no_repeat_ngram_mask = timed_kernel
    try:
        seconds, (search, _) = timed(ours)
    finally:
        sampling.no_repeat_ngram_mask = kernel
    fd, tf_ = statistics.median(times["fastdecode"]), statistics.median(times["transformers"])
    return {"model": name, "fastdecode_s": fd, "transformers_s": tf_, "fd_sps": settings.batch / fd,
            "tf_sps": settings.batch / tf_, "speedup": tf_ / fd, "identical": f"{same}/{len(outputs['fastdecode'])}",
            "shared": shared, "per_beam": per_beam, "their_cache": their_cache, "rss": peak_rss_mib(),
            "ngram_ms_per_step": 1000 * sum(spent) / max(len(spent), 1), "ngram_share": sum(spent) / seconds,
            "steps": search.steps}


def _hf_cache_bytes(cache) -> int:
    """Bytes of every tensor in a transformers cache object (decoder self-attention and cross-attention)."""
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
    if args.threads:
        settings.threads = args.threads
    torch.set_num_threads(settings.threads)
    builders = {"bart-base size": build_bart, "gpt2 size": build_gpt2}
    chosen = {name: fn for name, fn in builders.items() if name.split("-")[0].split()[0] in args.models.split(",")}

    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode(False):
        for index, (name, build) in enumerate(chosen.items()):
            rows.append(run_model(name, build, settings, Path(tmp) / str(index)))

    mib = 1 / 2**20
    print(f"\n# Beam search: {settings.batch} prompts x {settings.prompt_length} tokens, beam {settings.beams}, "
          f"no_repeat_ngram_size {settings.ngram}, length_penalty {settings.length_penalty}, "
          f"{settings.new_tokens} new tokens, float32, CPU ({platform.processor() or platform.machine()}, "
          f"{settings.threads} thread(s), torch {torch.__version__})\n")
    print("| model | transformers samples/s | fastdecode samples/s | speedup | identical | fastdecode K/V MiB "
          "(once per sample + per beam) | transformers K/V MiB | peak RSS MiB | n-gram ms/step | n-gram share |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['tf_sps']:.2f} | {r['fd_sps']:.2f} | {r['speedup']:.2f}x | {r['identical']} | "
              f"{r['shared'] * mib:.1f} + {r['per_beam'] * mib:.1f} | {r['their_cache'] * mib:.1f} | "
              f"{r['rss']:.0f} | {r['ngram_ms_per_step']:.2f} | {100 * r['ngram_share']:.2f}% |")
    print(f"\nTargets: >= {TARGET_SPEEDUP:.0f}x transformers samples/s; n-gram blocking < "
          f"{100 * TARGET_NGRAM_SHARE:.0f}% of decode time.")
    for r in rows:
        speed = "meets" if r["speedup"] >= TARGET_SPEEDUP else "misses"
        ngram = "meets" if r["ngram_share"] < TARGET_NGRAM_SHARE else "misses"
        print(f"- {r['model']}: {r['speedup']:.2f}x ({speed} the speed target); n-gram blocking "
              f"{100 * r['ngram_share']:.2f}% ({ngram} its target); {r['steps']} beam steps")
    print(f"\ntotal benchmark time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
