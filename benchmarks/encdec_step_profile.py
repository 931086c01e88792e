#!/usr/bin/env python
"""Where a bart-base greedy decode step's time goes: fastdecode and transformers op by op (issue 29).

encdec_speed.py's job (the bart-base-size random BART, saved and loaded with ``fastdecode.load``; 8 sources
x 256 tokens, greedy, ``min_new_tokens`` = ``max_new_tokens``), one call per engine under
``torch.profiler``, the engines one after the other in this process. Each op is put on the source side
(the encoder, the cross K/V projection, the cross store's write) when its first matrix input has a
256- or 2048-long dimension (the cross store's block copies have none: they count on the step side,
once per call), else on the step side; the step side's self CPU time is divided by the new tokens. Products are named by their shape (rows x inputs -> outputs), so the logits layer, each
decoder product and the attention ops read side by side. Self CPU time on a busy machine includes
waiting for memory and for the core: compare the two engines within one run, and run it twice.

    python benchmarks/encdec_step_profile.py [--threads 2] [--new-tokens 17] [--rows 14]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import harness
from random_models import build_bart, random_ids, saved_pair

SOURCE_DIMS = (256, 2048)  # a source's tokens, 8 sources' tokens


def step_ops(run, new_tokens: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(seconds of the profiled call, source-side op -> self CPU ms, step-side op -> self CPU ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run(new_tokens)
    seconds = time.perf_counter() - start
    source: dict[str, float] = {}
    step: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=True):
        matrices = [s for s in event.input_shapes if isinstance(s, list) and len(s) >= 2]
        first = matrices[0] if matrices else []
        name = event.key.replace("fastdecode_kernels::", "").replace("aten::", "")
        if name in ("mm", "addmm", "float_matmul") and len(matrices) > 1:
            name += f" {first[0]}x{first[-1]}->{matrices[1][-1]}"  # rows x inputs -> outputs
        side, per = (source, 1) if any(d in first for d in SOURCE_DIMS) else (step, new_tokens)
        side[name] = side.get(name, 0.0) + event.self_cpu_time_total / 1e3 / per
    return seconds, source, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--rows", type=int, default=14, help="ops listed per engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder, torch.inference_mode(False):
        hf, gen = saved_pair(build_bart, Path(folder))
        sources = random_ids(8, 256, hf.config.vocab_size)
        ids, mask = sources.tolist(), torch.ones_like(sources)

        def theirs(n: int):
            with torch.inference_mode():
                return hf.generate(sources, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   num_beams=1, no_repeat_ngram_size=0)

        engines = {"fastdecode": lambda n: gen.generate_ids(ids, max_new_tokens=n, min_new_tokens=n),
                   "transformers": theirs}
        print(f"# bart-base size greedy, 8 x 256 sources, {args.new_tokens} new tokens, float32\n")
        for name, run in engines.items():
            run(2)  # warm-up
            seconds, source, step = step_ops(run, args.new_tokens)
            print(f"## {name}: the call {seconds:.2f} s (profiled); source side {sum(source.values()) / 1e3:.2f} s "
                  f"self CPU; decode steps {sum(step.values()):.1f} ms self CPU per step\n")
            for side, ops, unit in (("step", step, "ms per step"), ("source", source, "ms per call")):
                rows = sorted(ops.items(), key=lambda item: -item[1])[: args.rows]
                print(harness.table([f"op ({side} side)", unit], [[op, f"{ms:.2f}"] for op, ms in rows]) + "\n")
        print(harness.machine_line(args.threads))


if __name__ == "__main__":
    main()
