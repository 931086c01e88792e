#!/usr/bin/env python
"""Two source trees' decoding beside busy processes (a loaded shared machine), A/B, per load and thread count.

    python benchmarks/loaded_ab.py --trees /work/main/src,src [--load 0,1,2,4] [--threads 1,2] [--rounds 6]
        [--busy python|gemm] [--ct2]

One persistent worker process per tree (its ``src`` first on PYTHONPATH; a third with ``--ct2``: CTranslate2
int8 on the same model, an OpenMP engine, for how one of those degrades). For each ``--load`` level the script
starts that many busy processes of its own (``--busy python``: ``while True: pass``; ``gemm``: a numpy
float32 matrix product loop on one thread, which also uses the memory bus), waits a second, and for each
job times rounds of A B B A on each ``--threads`` count in turn (load that drifts over seconds hits both trees
and all thread counts alike):

* ``b1``: batch-1 greedy decoding of the embedded SmolLM2-135M Q4_1 as ``fastdecode.load()`` gives it,
  a 30-token prompt and ``--new-tokens`` new ones, the whole call (tok/s);
* ``f16``: 16 rows of the same model dequantized to float32 (what ``fastdecode serve`` serves as float32):
  16 prompts queued on an engine, stepped until each has its first token, then ``--steps`` decode steps of
  16 rows timed (generated tok/s).

Reported per load, threads and job: each tree's median tok/s, the median of the per-round ratios B / A with
its quartiles, A's speed against its speed on the first thread count in the same rounds, the involuntary context
switches per call of each tree's worker (its threads lost their core), the load average, and the cores kept busy
by everything but the workers (this script's busy processes and the machine's other users: read the figures with
them in mind). The busy processes run at the same priority as the workers, each in a session of its own: where
the kernel groups a session's threads for scheduling (autogroup, on by default on many Linux systems), each is a
group of its own, as another user's program, and a worker's threads share its group's time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from decode_engines import PROMPT_IDS, batch_prompts
from harness import Contention, Worker, machine_line, median, percentile, quiet_env, stop_process, table
from peers.ctranslate2 import prepare_ctranslate2

CACHE = Path(tempfile.gettempdir()) / "fastdecode-bench"
BUSY = {"python": "while True: pass",
        "gemm": ("import os; os.environ['OPENBLAS_NUM_THREADS'] = os.environ['OMP_NUM_THREADS'] = '1'\n"
                 "import numpy; a = numpy.ones((512, 512), numpy.float32)\nwhile True: a @ a")}


# --- the workers ---------------------------------------------------------------------------------
class FastdecodeJobs:
    """Both models of one tree; ``op_run`` times a job on a thread count."""

    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.tree = fastdecode.__file__
        self.quantized = fastdecode.load()
        self.float32 = fastdecode.load(quantize="dequantize")

    def ready_info(self) -> dict[str, Any]:
        self.quantized.generate_ids([PROMPT_IDS], max_new_tokens=4, eos_token_id=[])
        self.float_steps(2)
        return {"tree": self.tree}

    def float_steps(self, steps: int) -> tuple[float, int]:
        """16 rows queued, stepped past their prompts, then ``steps`` decode steps timed -> (seconds, tokens)."""
        engine = self.float32.engine()
        options = {"max_new_tokens": steps + 1, "min_new_tokens": steps + 1, "do_sample": False}
        rows = [engine.submit(ids, options) for ids in batch_prompts(16)]
        while any(row.num_tokens == len(row.prompt_ids) for row in rows):
            engine.step()
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        seconds = time.perf_counter() - started
        while engine.has_work():
            engine.step()
        return seconds, 16 * steps

    def op_run(self, job: str, threads: int, new_tokens: int, steps: int) -> dict[str, Any]:
        import torch

        torch.set_num_threads(threads)
        before, cpu = resource.getrusage(resource.RUSAGE_SELF), harness.cpu_seconds()
        if job == "b1":
            started = time.perf_counter()
            self.quantized.generate_ids([PROMPT_IDS], max_new_tokens=new_tokens, eos_token_id=[])
            seconds, tokens = time.perf_counter() - started, new_tokens
        else:
            seconds, tokens = self.float_steps(steps)
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {"seconds": seconds, "tokens": tokens, "cpu_s": harness.cpu_seconds() - cpu,
                "involuntary": after.ru_nivcsw - before.ru_nivcsw, "voluntary": after.ru_nvcsw - before.ru_nvcsw}


class CTranslate2Jobs:
    """CTranslate2 int8 on the embedded model, one generator per thread count (its threads are fixed)."""

    def __init__(self, options: dict[str, Any]):
        import ctranslate2

        self.models = {t: ctranslate2.Generator(options["ct2_dir"], device="cpu", compute_type="int8",
                                                inter_threads=1, intra_threads=t) for t in options["thread_counts"]}
        self.vocab = json.loads(Path(options["vocab"]).read_text())

    def generate(self, threads: int, prompts: list[list[int]], new_tokens: int) -> None:
        tokens = [[self.vocab[i] for i in p] for p in prompts]
        self.models[threads].generate_batch(tokens, max_length=new_tokens, min_length=new_tokens, sampling_topk=1,
                                            include_prompt_in_result=False)

    def op_run(self, job: str, threads: int, new_tokens: int, steps: int) -> dict[str, Any]:
        before, cpu = resource.getrusage(resource.RUSAGE_SELF), harness.cpu_seconds()
        started = time.perf_counter()
        if job == "b1":
            self.generate(threads, [PROMPT_IDS], new_tokens)
            seconds, tokens = time.perf_counter() - started, new_tokens
        else:  # the same 16 rows' whole call: CTranslate2 has no step API (prompts included)
            self.generate(threads, batch_prompts(16), steps)
            seconds, tokens = time.perf_counter() - started, 16 * steps
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {"seconds": seconds, "tokens": tokens, "cpu_s": harness.cpu_seconds() - cpu,
                "involuntary": after.ru_nivcsw - before.ru_nivcsw, "voluntary": after.ru_nvcsw - before.ru_nvcsw}


def make_jobs(options: dict[str, Any]):
    return CTranslate2Jobs(options) if options.get("ct2_dir") else FastdecodeJobs(options)


# --- the parent ----------------------------------------------------------------------------------
def start_busy(count: int, kind: str) -> list[subprocess.Popen]:
    """Each in a session of its own: with the kernel's autogroup scheduling (sched_autogroup_enabled), as another
    user's program, a group of its own, not a share of this script's."""
    return [subprocess.Popen([sys.executable, "-c", BUSY[kind]], env=quiet_env(OMP_NUM_THREADS="1"),
                             start_new_session=True) for _ in range(count)]


def run_level(workers: dict[str, Worker], names: list[str], thread_counts: list[int], job: str,
              args) -> dict[str, Any]:
    """Rounds of A B B A per thread count, the counts in turn within a round (CTranslate2 once per count and
    round): drift in the load hits trees and thread counts alike -> the replies per (threads, name), the load."""
    replies: dict[tuple[int, str], list[dict]] = {(t, name): [] for t in thread_counts for name in workers}
    order = names + names[::-1] + [n for n in workers if n not in names]
    meter, others = Contention(), 0.0
    for _ in range(args.rounds):
        for threads in thread_counts:
            for name in order:
                reply = workers[name].call("run", job=job, threads=threads, new_tokens=args.new_tokens,
                                           steps=args.steps)
                replies[threads, name].append(reply)
                others += reply["cpu_s"]
    return {"replies": replies, "other_cores": meter.other_cores(others), "load": os.getloadavg()[0]}


def summarize(replies: dict[tuple[int, str], list[dict]], threads: int, first: int, names: list[str]) -> dict[str, Any]:
    """Per name its median tok/s on ``threads``; per round the ratio B / A of the two calls' mean speeds, and
    A's speed on ``threads`` against its speed on ``first`` threads in the same round."""
    speed = {name: [r["tokens"] / r["seconds"] for r in replies[t, name]] for t, name in replies if t == threads}
    first_a = [r["tokens"] / r["seconds"] for r in replies[first, names[0]]]
    a, b = names
    pair = range(len(speed[a]) // 2)
    return {"speed": {name: median(v) for name, v in speed.items()},
            "ratios": [(speed[b][2 * i] + speed[b][2 * i + 1]) / (speed[a][2 * i] + speed[a][2 * i + 1]) for i in pair],
            "against_first": [(speed[a][2 * i] + speed[a][2 * i + 1]) / (first_a[2 * i] + first_a[2 * i + 1])
                              for i in pair],
            "switches": {name: median(r["involuntary"] for r in replies[threads, name]) for name in names}}


def quartiles(values: list[float]) -> str:
    return f"{median(values):.3f} ({percentile(values, 25):.3f}-{percentile(values, 75):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", help="A,B: two source trees' src folders")
    parser.add_argument("--load", default="0,1,2,4", help="busy processes started by the script, per level")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--jobs", default="b1,f16")
    parser.add_argument("--rounds", type=int, default=6, help="rounds A B B A per level, threads and job")
    parser.add_argument("--new-tokens", type=int, default=64, help="b1: new tokens per call")
    parser.add_argument("--steps", type=int, default=16, help="f16: timed decode steps per call")
    parser.add_argument("--busy", choices=sorted(BUSY), default="python")
    parser.add_argument("--ct2", action="store_true", help="CTranslate2 int8 on the same jobs, for reference")
    harness.add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        harness.serve_worker(make_jobs, json.loads(args.options))
        return
    if not args.trees or len(args.trees.split(",")) != 2:
        parser.error("--trees takes two src folders, A,B")
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    names, thread_counts = ["A", "B"], [int(t) for t in args.threads.split(",")]
    log_dir = Path(tempfile.mkdtemp(prefix="loaded_ab-"))
    workers = {name: Worker(__file__, name, {"threads": 1}, log_dir, env=quiet_env(PYTHONPATH=tree))
               for name, tree in zip(names, trees)}
    ct2 = prepare_ctranslate2(harness.embedded_model_path(), CACHE) if args.ct2 else None
    if ct2:
        workers["CT2 int8"] = Worker(__file__, "CT2 int8", {"threads": 1, "thread_counts": thread_counts, **ct2},
                                     log_dir, env=quiet_env(OMP_NUM_THREADS=str(max(thread_counts))))
    try:
        for name, worker in workers.items():
            ready = worker.wait_ready()
            if name in names and not ready["tree"].startswith(trees[names.index(name)]):
                raise SystemExit(f"{name}: fastdecode was imported from {ready['tree']}")
        rows = []
        for load in (int(n) for n in args.load.split(",")):
            busy = start_busy(load, args.busy)
            try:
                time.sleep(1.0)
                for job in args.jobs.split(","):
                    level = run_level(workers, names, thread_counts, job, args)
                    for threads in thread_counts:
                        result = summarize(level["replies"], threads, thread_counts[0], names)
                        rows.append([load, threads, job, f"{level['load']:.1f}", f"{level['other_cores']:.1f}",
                                     *(f"{result['speed'][n]:.1f}" for n in names), quartiles(result["ratios"]),
                                     quartiles(result["against_first"]),
                                     f"{result['switches']['A']:.0f} / {result['switches']['B']:.0f}",
                                     f"{result['speed']['CT2 int8']:.1f}" if ct2 else "-"])
                        print("  " + " | ".join(str(c) for c in rows[-1]), file=sys.stderr, flush=True)
            finally:
                for process in busy:
                    stop_process(process, grace=5)
    finally:
        harness.close_all(workers)
    print(f"\n{machine_line(max(thread_counts))}; A = {trees[0]}, B = {trees[1]}; busy processes: {args.busy}; "
          f"{args.rounds} rounds A B B A; b1: {args.new_tokens} new tokens per call, f16: {args.steps} steps of 16 rows\n")
    print(table(["busy processes", "threads", "job", "load average", "cores busy besides the workers",
                 "A tok/s", "B tok/s", "B / A (quartiles)",
                 f"A against A on {thread_counts[0]} thread(s)", "involuntary switches per call A / B", "CT2 int8 tok/s"],
                rows))


if __name__ == "__main__":
    main()
