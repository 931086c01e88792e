#!/usr/bin/env python
"""Decode-speed benchmark: fastdecode against transformers (and CTranslate2 when installed).

Everything runs on CPU on the embedded SmolLM2-135M-Instruct GGUF, greedy, with the same prompt
token ids for every engine. See benchmarks/README.md for what each section measures.

    python benchmarks/decode_speed.py                 # full run (~10 minutes on 2 cores)
    python benchmarks/decode_speed.py --quick         # smoke run (~2 minutes)
    python benchmarks/decode_speed.py --json out.json # also write every raw number as JSON
    python benchmarks/decode_speed.py --model gemma3  # the real Gemma 3 270M (Q4_K_M GGUF) instead

Each engine lives in its own worker process (harness.Worker), so that its peak RSS is its own; the
parent sends one request at a time and alternates engines between repetitions (A/B/A/B).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import decode_engines as engines
import harness
from decode_engines import ENGINES, batch_prompts, long_prompt, model_path
from decode_report import render
from harness import Worker, median, wait_for_quiet
from peers.ctranslate2 import prepare_ctranslate2

COLD_START_PROMPT = "What is the capital of France?"


@dataclasses.dataclass
class Settings:
    """How much work each section does; ``--quick`` shrinks everything."""

    new_tokens: int = 128
    reps: int = 3
    batch_sizes: tuple[int, ...] = (1, 8)
    short_context: int = 128
    long_context: int = 1024
    cached_steps: int = 8
    naive_steps_short: int = 8
    naive_steps_long: int = 2  # the naive path re-runs the whole sequence: seconds per step at 1024
    context_reps: int = 3
    naive_long_reps: int = 1
    cold_start_runs: int = 3
    bandwidth_trials: int = 10
    quiet_wait: float = 0.0  # before each timed run, wait up to this long for other processes to go quiet
    threads: int = 0  # 0: every CPU this process may use

    @classmethod
    def quick(cls) -> "Settings":
        return cls(new_tokens=16, reps=2, long_context=256, cached_steps=4, naive_steps_short=2,
                   naive_steps_long=1, context_reps=1, cold_start_runs=1, bandwidth_trials=3)


# --- sections (parent side) ----------------------------------------------------------------------
def start_workers(settings: Settings, ct2_options: dict[str, Any] | None, log_dir: Path) -> dict[str, Worker]:
    """Start every available engine's worker (loads run in parallel) and wait until all are loaded."""
    base = {"threads": settings.threads, "model": engines.MODEL}
    wanted = {"fastdecode": base}
    if importlib.util.find_spec("transformers") is not None:
        wanted["transformers"] = base
    if ct2_options is not None:
        wanted["ctranslate2"] = {**base, **ct2_options}
    workers, _ = harness.start_workers(Path(__file__).resolve(), wanted, log_dir, required=["fastdecode"])
    return workers


def warm_up(workers: dict[str, Worker], settings: Settings) -> None:
    """A short generation per engine and batch size, then restart each process's peak-RSS count."""
    for worker in workers.values():
        for batch in settings.batch_sizes:
            worker.call("generate", prompts=batch_prompts(batch), new_tokens=4)
        worker.call("mark_loaded")


def bench_throughput(workers: dict[str, Worker], settings: Settings) -> dict[str, Any]:
    """tokens/s per engine and batch size; engines alternate within every repetition (A/B/A/B)."""
    jobs = {batch: {"prompts": batch_prompts(batch), "new_tokens": settings.new_tokens}
            for batch in settings.batch_sizes}
    runs = harness.alternate_workers(workers, jobs, settings.reps, settings.quiet_wait)
    summary: dict[str, Any] = {}
    for name, by_batch in runs.items():
        summary[name] = {}
        for batch, replies in by_batch.items():
            produced = [sum(len(row) for row in r["rows"]) for r in replies]
            rates = [n / r["seconds"] for n, r in zip(produced, replies)]
            summary[name][batch] = {
                "median_tokens_per_s": median(rates), "runs_tokens_per_s": rates,
                "median_other_load": median(r["other_cores"] for r in replies),
                "all_lengths_ok": all(n == batch * settings.new_tokens for n in produced),
                "deterministic": all(r["rows"] == replies[0]["rows"] for r in replies),
                "tokens": replies[0]["rows"],
            }
    return summary


def compare_tokens(a: list[list[int]], b: list[list[int]], eos_ids: list[int]) -> dict[str, Any]:
    """Row-by-row equality of fastdecode's rows ``a`` and another engine's rows ``b``.

    fastdecode runs with no EOS while the others reach 128 tokens through min_new_tokens, which
    masks the EOS logit: where fastdecode picks an EOS id the others cannot, by construction. So each
    row is compared up to (not including) fastdecode's first EOS; such rows are listed in ``cut_at_eos``.
    """
    rows_equal, cut_at_eos, first_difference = 0, {}, None
    for row, (x, y) in enumerate(zip(a, b)):
        end = next((i for i, token in enumerate(x) if token in eos_ids), len(x))
        if end < len(x):
            cut_at_eos[row] = end
        diff = next((i for i, (u, v) in enumerate(zip(x[:end], y[:end])) if u != v), None)
        if diff is None and len(y) < end:
            diff = len(y)
        if diff is None:
            rows_equal += 1
        elif first_difference is None:
            first_difference = {"row": row, "new_token": diff}
    return {"identical": rows_equal == len(a) == len(b), "rows_equal": rows_equal, "rows": len(a),
            "first_difference": first_difference, "cut_at_eos": cut_at_eos}


def bench_context(worker: Worker, settings: Settings) -> dict[str, Any]:
    """Per-step decode time after short and long prompts, cached and naive (use_cache=False).

    A prompt of ``context - steps`` tokens followed by ``steps + 1`` new tokens: the gaps between
    streamed tokens are decode steps whose context ends at ``context``; prefill is excluded.
    """
    plan = [("cached", True, settings.short_context, settings.cached_steps, settings.context_reps),
            ("cached", True, settings.long_context, settings.cached_steps, settings.context_reps),
            ("naive", False, settings.short_context, settings.naive_steps_short, settings.context_reps),
            ("naive", False, settings.long_context, settings.naive_steps_long, settings.naive_long_reps)]
    result: dict[str, Any] = {}
    for path, use_cache, context, steps, reps in plan:
        gaps, prefill = [], []
        for _ in range(reps):
            wait_for_quiet(settings.quiet_wait)
            reply = worker.call("step_times", prompt=long_prompt(context - steps), new_tokens=steps + 1,
                                use_cache=use_cache)
            gaps += reply["step_s"]
            prefill.append(reply["first_token_s"])
        result.setdefault(path, {})[context] = {"median_step_s": median(gaps), "steps": gaps,
                                                 "prefill_s": median(prefill)}
        print(f"  {path} context {context}: {median(gaps) * 1000:.1f} ms/step", file=sys.stderr)
    return result


def time_to_first_output(command: list[str], quiet_wait: float = 0.0) -> dict[str, float]:
    """Seconds from process start to the first non-whitespace byte on its stdout, and to its exit."""
    wait_for_quiet(quiet_wait)
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0,
                            env=harness.quiet_env())
    first_byte = first_visible = None
    while True:
        chunk = os.read(proc.stdout.fileno(), 4096)
        now = time.perf_counter()
        if not chunk:
            break
        first_byte = first_byte or now
        if first_visible is None and chunk.strip():
            first_visible = now
    proc.wait()
    ended = time.perf_counter()
    first = first_visible or first_byte or ended
    return {"first_output_s": first - started, "exit_s": ended - started, "returncode": proc.returncode}


def bench_cold_start(settings: Settings) -> dict[str, Any]:
    """`fastdecode generate ... --max-new-tokens 1` (N runs) and transformers' equivalent (1 run)."""
    result: dict[str, Any] = {}
    cli = Path(sys.executable).with_name("fastdecode")
    cli_path = str(cli) if cli.exists() else shutil.which("fastdecode")
    if cli_path:
        model = ["-m", str(model_path())] if engines.MODEL != "smollm2" else []  # default: the embedded model
        command = [cli_path, "generate", *model, "--prompt", COLD_START_PROMPT, "--max-new-tokens", "1"]
        runs = [time_to_first_output(command, settings.quiet_wait) for _ in range(settings.cold_start_runs)]
        ok = [r["first_output_s"] for r in runs if r["returncode"] == 0]
        result["fastdecode"] = {"median_s": median(ok), "runs": runs, "failed": len(runs) - len(ok)}
        print(f"  fastdecode CLI first token: {median(ok):.2f} s", file=sys.stderr)
    if importlib.util.find_spec("transformers") is not None:
        run = time_to_first_output([sys.executable, str(Path(__file__).resolve()), "--role", "hf-cold-start",
                                    "--model", engines.MODEL], settings.quiet_wait)
        ok = [run["first_output_s"]] if run["returncode"] == 0 else []
        result["transformers"] = {"median_s": median(ok), "runs": [run], "failed": 1 - len(ok)}
        print(f"  transformers first token: {median(ok):.2f} s", file=sys.stderr)
    return result


def hf_cold_start() -> None:
    """Runs in a subprocess: what `fastdecode generate` does, with transformers (chat template, 1 token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    text = COLD_START_PROMPT  # as `fastdecode generate`: the chat template when the model has one
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=1, do_sample=False)
    piece = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    sys.stdout.write((piece.strip() or "<token>") + "\n")
    sys.stdout.flush()


# --- main ----------------------------------------------------------------------------------------
def run(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    started, meter = time.perf_counter(), harness.Contention()
    results: dict[str, Any] = {"quick": args.quick, "settings": dataclasses.asdict(settings),
                               "model_name": engines.MODEL,
                               "machine": {"line": harness.machine_line(settings.threads), "cpus": harness.cpu_count(),
                                           "load_average_start": os.getloadavg()},
                               "prompt_ids": engines.PROMPT_IDS, "cold_start_prompt": COLD_START_PROMPT}
    print("measuring memory bandwidth ...", file=sys.stderr)
    results["bandwidth"] = harness.measure_bandwidth(settings.threads, settings.bandwidth_trials, settings.quiet_wait)
    ct2_options = None
    if not args.no_ct2 and engines.MODEL == "smollm2":
        ct2_options = prepare_ctranslate2(model_path(), Path(args.ct2_cache))
    with tempfile.TemporaryDirectory(prefix="decode_speed_") as log_dir:
        print("loading engines ...", file=sys.stderr)
        workers = start_workers(settings, ct2_options, Path(log_dir))
        try:
            results["load_s"] = {name: w.ready["engine_s"] for name, w in workers.items()}
            results["machine"]["torch"] = workers["fastdecode"].ready["torch"]
            results["model"] = workers["fastdecode"].call("info")
            if "transformers" in workers:
                results["model"]["transformers_bytes_per_step"] = workers["transformers"].call("info")["bytes_per_step"]
            warm_up(workers, settings)
            print("throughput ...", file=sys.stderr)
            results["throughput"] = bench_throughput(workers, settings)
            results["memory"] = {name: w.call("memory") for name, w in workers.items()}
            for name in [n for n in workers if n != "fastdecode"]:
                workers.pop(name).close()  # free their memory before the long-context runs
            print("per-step decode time ...", file=sys.stderr)
            results["context"] = bench_context(workers["fastdecode"], settings)
        finally:
            harness.close_all(workers)
    fd = results["throughput"]["fastdecode"]
    checks = {}
    for other in ("transformers", "ctranslate2"):
        for batch in settings.batch_sizes if other in results["throughput"] else ():
            checks[f"fastdecode vs {other}, batch {batch}"] = compare_tokens(
                fd[batch]["tokens"], results["throughput"][other][batch]["tokens"], results["model"]["eos_token_ids"])
    results["token_checks"] = checks
    print("cold start ...", file=sys.stderr)
    results["cold_start"] = bench_cold_start(settings)
    results["machine"]["load_average_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    results["machine"]["other_load_avg"] = meter.other_cores()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2",
                        help="the embedded SmolLM2-135M (default) or the real Gemma 3 270M Q4_K_M GGUF")
    parser.add_argument("--quick", action="store_true", help="short smoke run (16 tokens, fewer reps, context 256)")
    parser.add_argument("--json", metavar="PATH", help="also write all results (raw runs included) as JSON")
    parser.add_argument("--reps", type=int, help="repetitions per engine and batch size (default 3; quick 2)")
    parser.add_argument("--new-tokens", type=int, help="new tokens per generation (default 128; quick 16)")
    parser.add_argument("--threads", type=int, default=0, help="torch / CTranslate2 threads (default: all CPUs)")
    parser.add_argument("--wait-for-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="on a shared machine: before each timed run, wait up to SECONDS until other processes "
                             "use < 0.3 cores (default 0: off)")
    parser.add_argument("--no-ct2", action="store_true", help="skip CTranslate2 even if it is installed")
    parser.add_argument("--ct2-cache", default=str(Path(tempfile.gettempdir()) / "fastdecode-bench"),
                        help="where the CTranslate2 conversion is kept between runs (default: %(default)s)")
    parser.add_argument("--role", default="main", choices=["main", "hf-cold-start"], help=argparse.SUPPRESS)
    harness.add_worker_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = json.loads(args.options)
    engines.select_model(options.get("model", args.model))
    if args.worker:
        return harness.serve_worker(ENGINES[args.worker], options)
    if args.role == "hf-cold-start":
        return hf_cold_start()
    settings = Settings.quick() if args.quick else Settings()
    settings.threads = args.threads or harness.cpu_count()
    settings.reps = args.reps or settings.reps
    settings.new_tokens = args.new_tokens or settings.new_tokens
    settings.quiet_wait = args.wait_for_quiet
    results = run(settings, args)
    print(render(results, settings))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
