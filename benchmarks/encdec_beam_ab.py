#!/usr/bin/env python
"""Encoder-decoder generation, this tree against another fastdecode tree (A/B).

The job of issue 30's quantized BART row: a bart-base-size random BART (quantized_speed.py's, built in
/tmp/fastdecode-bench/bart-base-random if missing), ``quantize="int8"`` (the native int8 kernels),
8 sources x 256 tokens, beam 4, 16 new tokens (``min_new_tokens`` too, so both do the same work),
through the public API both trees share (``fastdecode.load`` + ``generate_ids``). Issue 29's float32
rows: ``--quantize none`` (the float32 checkpoint as it is), ``--beams 1`` (greedy) or ``--ngram 3``
(beam_speed.py's no-repeat-3).

Every repetition starts a fresh worker process per tree, this tree then the baseline (alternating,
so drift in machine load hits both alike), each with its own ``src`` first on PYTHONPATH; a worker
runs the job twice: the second call is the timed one (wall and CPU seconds; the first pays page
faults, allocator growth and lazy set-up, shown beside it). Medians with min-max, the ratio
baseline / this tree of the second calls (above 1: this tree is faster), whether both trees' beams
are identical, and the load average; then where the timed calls' time went, in ms per new token: the
encoder and cross K/V projection (``CrossStore.encode_pending``), the decoder's forwards (``BartModel.decode``),
the beam selection (the sampler's ``advance_groups``) and the rest (step planning, the cache's copies).

    python benchmarks/encdec_beam_ab.py --baseline /work/bench-base [--reps 8] [--threads 1]
    python benchmarks/encdec_beam_ab.py --baseline /work/main --quantize none --beams 1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from harness import Worker, median, spread, table

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
FOLDER = Path(tempfile.gettempdir()) / "fastdecode-bench" / "bart-base-random"


# The parts of a call timed inside the worker: (module, attribute path, part), where the tree has them.
PARTS = (("fastdecode.engine.cross", "CrossStore.encode_pending", "encoder + cross K/V"),
         ("fastdecode.models.bart", "BartModel.decode", "decoder forward"),
         ("fastdecode.engine.sampler", "advance_groups", "beam selection"))


class BeamEngine:
    """The worker side: one tree's fastdecode with the model loaded natively as int8 (or as saved), the
    seconds of each of ``PARTS`` in the last call kept for ``op_parts``."""

    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.gen = fastdecode.load(options["source"], quantize=options["quantize"])
        self.module = fastdecode.__file__
        self.spent: dict[str, float] = {}
        for module, path, part in PARTS:
            self._time(module, path, part)

    def _time(self, module: str, path: str, part: str) -> None:
        import importlib

        *owner_names, name = path.split(".")
        owner = importlib.import_module(module)
        for owner_name in owner_names:
            owner = getattr(owner, owner_name, None)
        fn = getattr(owner, name, None)
        if fn is None:
            return

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - started

        setattr(owner, name, timed)

    def ready_info(self) -> dict[str, Any]:
        return {"module": self.module}

    def generate(self, prompts, new_tokens, num_beams, ngram=0):
        self.spent = {}
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                     num_beams=num_beams, no_repeat_ngram_size=ngram)

    def op_parts(self) -> dict[str, float]:
        """Seconds of each timed part in the last ``generate``."""
        return dict(self.spent)


def run_once(name: str, tree: Path, options: dict[str, Any], job: dict[str, Any],
             log_dir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh worker of ``tree``: the job twice -> (the first call's reply, the second's: seconds, cpu_s, rows)."""
    env = harness.quiet_env(PYTHONPATH=f"{tree / 'src'}:{HERE}")
    worker = Worker(Path(__file__).resolve(), name, options, log_dir, env=env)
    try:
        ready = worker.wait_ready()
        expected = str(tree / "src")
        if not ready["module"].startswith(expected):
            raise SystemExit(f"{name} imported fastdecode from {ready['module']}, not {expected}")
        first = worker.call("generate", **job)
        second = worker.call("generate", **job)
        return first, {**second, "parts": worker.call("parts")}
    finally:
        worker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="the other fastdecode tree (its src/ is used); required")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--quantize", default="int8", help='"int8", "int4" or "none" (float32 as saved)')
    parser.add_argument("--ngram", type=int, default=0, help="no_repeat_ngram_size (0: off)")
    harness.add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return harness.serve_worker(BeamEngine, json.loads(args.options))
    if args.baseline is None:
        parser.error("--baseline is required: the other fastdecode tree")
    if not (FOLDER / "config.json").exists():
        from random_models import build_bart

        build_bart().save_pretrained(FOLDER)
    quantize = None if args.quantize == "none" else args.quantize
    options = {"threads": args.threads, "source": str(FOLDER), "quantize": quantize}
    sources = [[(7 * i + 13 * j) % 50000 + 4 for j in range(256)] for i in range(8)]  # quantized_speed.py's
    job = {"prompts": sources, "new_tokens": args.new_tokens, "num_beams": args.beams, "ngram": args.ngram}
    trees = {"this tree": TREE, "baseline": args.baseline.resolve()}
    log_dir = Path(tempfile.mkdtemp(prefix="encdec-ab-"))
    replies: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    firsts: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for rep in range(args.reps):
        for name, tree in trees.items():
            first, reply = run_once(name, tree, options, job, log_dir)
            firsts[name].append(first)
            replies[name].append(reply)
            print(f"  rep {rep + 1}/{args.reps} {name:<10} {reply['seconds']:7.3f} s wall {reply['cpu_s']:7.3f} s CPU "
                  f"(first call {first['seconds']:.3f} s)", file=sys.stderr, flush=True)
    wall = {name: [r["seconds"] for r in rs] for name, rs in replies.items()}
    cpu = {name: [r["cpu_s"] for r in rs] for name, rs in replies.items()}
    rows = [[name, spread(wall[name], 3), spread(cpu[name], 3), spread([r["seconds"] for r in firsts[name]], 3),
             spread([r["cpu_s"] for r in firsts[name]], 3)] for name in trees]
    ratio_wall = median(wall["baseline"]) / median(wall["this tree"])
    ratio_cpu = median(cpu["baseline"]) / median(cpu["this tree"])
    same = all(r["rows"] == replies["baseline"][0]["rows"] for rs in (*replies.values(), *firsts.values()) for r in rs)
    print(f"## bart-base size (random), {args.quantize}, 8 x 256 source tokens, beam {args.beams}, "
          f"no-repeat {args.ngram}, "
          f"{args.new_tokens} new tokens, {args.threads} thread(s), {args.reps} fresh processes per tree\n")
    print(table(["tree", "wall s", "CPU s", "first call wall s", "first call CPU s"], rows))
    print(f"\n- speed vs baseline (baseline / this tree): wall {ratio_wall:.3f}x, CPU {ratio_cpu:.3f}x")
    print(f"- beams identical across trees and repetitions: {same}")
    print(f"- baseline: {args.baseline}; at the end: {harness.machine_line(args.threads)}")
    print("\nWhere a timed call's time went, ms per new token (medians; the source side once per call, divided too):\n")
    print(table(["tree", *(part for _, _, part in PARTS), "the rest"],
                [[name, *(f"{median(parts(r, part) for r in replies[name]) * 1e3 / args.new_tokens:.2f}"
                          for part in [p for _, _, p in PARTS] + ["the rest"])] for name in trees]))


def parts(reply: dict[str, Any], part: str) -> float:
    """Seconds of one timed part of a reply's call ("the rest": the call's wall time less every part)."""
    spent = reply["parts"]
    return reply["seconds"] - sum(spent.values()) if part == "the rest" else spent.get(part, 0.0)


if __name__ == "__main__":
    main()
