#!/usr/bin/env python
"""Quantized execution benchmark: the embedded Q4_1 GGUF run natively, against the field.

Engines (each in its own worker process; engines alternate within every repetition, medians):
fastdecode native (the GGUF's own blocks), fastdecode float32 (blocks dequantized at load),
llama.cpp on the same file (``llama-cpp-python``), CTranslate2 float32 and int8 (a conversion of the
same weights), transformers (the GGUF dequantized). Rows: load time, first token after process start,
tokens/s at batch 1 (64 new tokens) and batch 8 (128), prompt processing on a 512-token prompt,
resident memory, and the bandwidth limit for the bytes each engine reads per token.
Then a bart-base-size random model, 8 sources x 256 tokens, beam 4: fastdecode int8 / float32 vs
CTranslate2 int8 / float32.

    python benchmarks/quantized_speed.py [--reps 3] [--threads 2] [--quick] [--skip-bart] [--engines a,b]

Engines that are not installed are listed as such. llama-cpp-python's high-level API has no batched
generation: its batch-8 row is 8 prompts one after another (said in the table).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_speed import (PROMPT_IDS, batch_prompts, long_prompt, measure_bandwidth, memory_kib,  # noqa: E402
                          model_path, prepare_ctranslate2, quiet_env)

ENGINES = ("fastdecode-native", "fastdecode-float32", "llama.cpp", "ct2-float32", "ct2-int8", "transformers")
BART_ENGINES = ("fastdecode-int8", "fastdecode-float32", "ct2-int8", "ct2-float32")


# --- workers -----------------------------------------------------------------------------------
class Engine:
    """generate(prompts, new_tokens) -> rows of new ids; bytes_per_token for the bandwidth limit."""

    bytes_per_token: int | None = None


class Fastdecode(Engine):
    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.gen = fastdecode.load(options.get("source"), quantize=options.get("quantize"))
        self.bytes_per_token = self.gen.inspect()["weight_bytes_read_per_token"]

    def generate(self, prompts, new_tokens, num_beams=1):
        extra = {"num_beams": num_beams, "min_new_tokens": new_tokens} if num_beams > 1 else {"eos_token_id": []}
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, **extra)


class LlamaCpp(Engine):
    def __init__(self, options: dict[str, Any]):
        from llama_cpp import Llama

        path = model_path()
        self.llm = Llama(str(path), n_ctx=1024, n_batch=512, n_threads=options["threads"], verbose=False)
        self.bytes_per_token = path.stat().st_size

    def generate(self, prompts, new_tokens, num_beams=1):
        rows = []
        for prompt in prompts:  # no batched generation in the high-level API
            self.llm.reset()
            row = []
            for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
                row.append(token)
                if len(row) == new_tokens:
                    break
            rows.append(row)
        return rows


class CTranslate2(Engine):
    def __init__(self, options: dict[str, Any]):
        import ctranslate2

        compute = options["compute_type"]
        cls = ctranslate2.Translator if options.get("seq2seq") else ctranslate2.Generator
        self.model = cls(options["ct2_dir"], device="cpu", compute_type=compute, inter_threads=1,
                         intra_threads=options["threads"])
        self.seq2seq = bool(options.get("seq2seq"))
        self.vocab = json.loads(Path(options["vocab"]).read_text()) if options.get("vocab") else None

    def _tokens(self, ids):
        return [self.vocab[i] for i in ids]

    def generate(self, prompts, new_tokens, num_beams=1):
        tokens = [self._tokens(p) for p in prompts]
        if self.seq2seq:
            results = self.model.translate_batch(tokens, beam_size=num_beams, max_decoding_length=new_tokens,
                                                 min_decoding_length=new_tokens, return_scores=False)
            return [r.hypotheses[0] for r in results]
        results = self.model.generate_batch(tokens, max_length=new_tokens, min_length=new_tokens, sampling_topk=1,
                                            include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in results]


class Transformers(Engine):
    def __init__(self, options: dict[str, Any]):
        import torch
        from transformers import AutoModelForCausalLM

        path = model_path()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        self.bytes_per_token = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in
                                                                          self.model.parameters()}.values())

    def generate(self, prompts, new_tokens, num_beams=1):
        torch = self.torch
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()


def make_engine(name: str, options: dict[str, Any]) -> Engine:
    if name.startswith("fastdecode"):
        return Fastdecode(options)
    if name == "llama.cpp":
        return LlamaCpp(options)
    if name.startswith("ct2"):
        return CTranslate2(options)
    return Transformers(options)


def worker_main(name: str, options: dict[str, Any]) -> None:
    """JSON lines on stdin -> JSON lines on the real stdout (library chatter goes to stderr)."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import torch

    torch.set_num_threads(options["threads"])
    started = options["launched_at"]
    engine = make_engine(name, options)
    loaded = time.time()
    first = engine.generate([options["first_prompt"]], 1)
    protocol.write(json.dumps({"load_s": loaded - started, "first_token_s": time.time() - started,
                               "bytes_per_token": engine.bytes_per_token, "first": first}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "exit":
            return
        if request["op"] == "memory":
            protocol.write(json.dumps(memory_kib()) + "\n")
            continue
        began = time.perf_counter()
        rows = engine.generate(request["prompts"], request["new_tokens"], request.get("num_beams", 1))
        protocol.write(json.dumps({"seconds": time.perf_counter() - began, "rows": rows}) + "\n")


class Worker:
    def __init__(self, name: str, options: dict[str, Any], log_dir: Path):
        self.name = name
        self.log = (log_dir / f"{name}.log").open("w")
        options = {**options, "launched_at": time.time()}
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--options", json.dumps(options)]
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, env=quiet_env())
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker died: see {self.log.name}")
        return json.loads(line)

    def call(self, **request) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.call(op="exit")
        except (OSError, RuntimeError, json.JSONDecodeError):
            pass
        self.proc.wait(timeout=60)
        self.log.close()


# --- sections ----------------------------------------------------------------------------------
def available(name: str) -> str | None:
    """None when the engine can run here, else why not."""
    needs = {"llama.cpp": "llama_cpp", "ct2-float32": "ctranslate2", "ct2-int8": "ctranslate2",
             "ct2-bart": "ctranslate2", "transformers": "transformers"}
    module = needs.get(name)
    return None if module is None or importlib.util.find_spec(module) else f"{module} not installed"


def ct2_options(threads: int) -> dict[str, Any] | None:
    prepared = prepare_ctranslate2(Path(tempfile.gettempdir()) / "fastdecode-bench", threads)
    if prepared is None:
        return None
    vocab_path = Path(prepared["ct2_dir"]) / "id_to_token.json"
    if not vocab_path.exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(prepared["hf_dir"]) / "tokenizer.json"))
        vocab_path.write_text(json.dumps([tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]))
    return {"ct2_dir": prepared["ct2_dir"], "vocab": str(vocab_path)}


def run_rounds(workers: dict[str, Worker], jobs: dict[str, dict[str, Any]], reps: int) -> dict[str, dict[str, float]]:
    """jobs: label -> request; every engine runs every job once per repetition, engines alternating."""
    times: dict[str, dict[str, list[float]]] = {n: {j: [] for j in jobs} for n in workers}
    for rep in range(reps):
        for label, request in jobs.items():
            for name, worker in workers.items():
                reply = worker.call(op="generate", **request)
                times[name][label].append(reply["seconds"])
                print(f"  rep {rep + 1}/{reps} {label:<10} {name:<20} {reply['seconds']:8.3f} s", file=sys.stderr)
    return {n: {j: statistics.median(v) for j, v in by_job.items()} for n, by_job in times.items()}


def embedded_section(args) -> str:
    options = {"threads": args.threads, "first_prompt": PROMPT_IDS[:8]}
    ct2 = ct2_options(args.threads) if available("ct2-int8") is None else None
    per_engine = {"fastdecode-native": {}, "fastdecode-float32": {"quantize": "dequantize"}, "llama.cpp": {},
                  "ct2-float32": {**(ct2 or {}), "compute_type": "float32"},
                  "ct2-int8": {**(ct2 or {}), "compute_type": "int8"}, "transformers": {}}
    log_dir = Path(tempfile.mkdtemp(prefix="quantized-bench-"))
    workers, missing = {}, {}
    for name in args.engines.split(",") if args.engines else ENGINES:
        why = available(name) or (None if not name.startswith("ct2") or ct2 else "conversion failed")
        if why is None:
            try:
                workers[name] = Worker(name, {**options, **per_engine[name]}, log_dir)
            except RuntimeError as exc:
                why = str(exc)
        if why:
            missing[name] = why
    new1, new8 = (16, 16) if args.quick else (64, 128)
    jobs = {"batch 1": {"prompts": batch_prompts(1), "new_tokens": new1},
            "batch 8": {"prompts": batch_prompts(8), "new_tokens": new8},
            "prompt 512": {"prompts": [long_prompt(512)], "new_tokens": 1}}
    medians = run_rounds(workers, jobs, args.reps)
    measured = measure_bandwidth(argparse.Namespace(threads=args.threads, bandwidth_trials=3, quiet_wait=0.0))
    bandwidth = max(measured.values())  # GB/s: the best of a plain sum and two GEMV layouts
    rows = []
    for name, worker in workers.items():
        m, ready = medians[name], worker.ready
        per_token = ready.get("bytes_per_token")
        limit = f"{bandwidth * 1e9 / per_token:.0f}" if per_token else "-"
        rss = worker.call(op="memory")["rss"] / 1024
        batch8 = f"{8 * new8 / m['batch 8']:.1f}" + (" (8 one by one)" if name == "llama.cpp" else "")
        rows.append([name, f"{ready['load_s']:.2f}", f"{ready['first_token_s']:.2f}", f"{new1 / m['batch 1']:.1f}",
                     batch8, f"{512 / m['prompt 512']:.0f}", f"{rss:.0f}",
                     f"{per_token / 1e6:.0f}" if per_token else "-", limit])
        worker.close()
    rate = {r[0]: (float(r[3]), float(r[4].split()[0]), float(r[5])) for r in rows}
    lines = [f"## Embedded SmolLM2-135M Q4_1 GGUF, {args.threads} threads, {args.reps} reps (medians); "
             f"memory bandwidth {bandwidth:.1f} GB/s", "",
             "| engine | load s | first token s | batch 1 tok/s | batch 8 tok/s | prompt 512 tok/s | RSS MB "
             "| MB read/token | bandwidth limit tok/s |", "|" + "---|" * 9]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [f"| {name} | not run: {why} |" + " |" * 7 for name, why in missing.items()]
    lines += ["", *targets(rate, {r[0]: r for r in rows})]
    return "\n".join(lines)


def targets(rate: dict[str, tuple[float, float, float]], rows: dict[str, list[str]]) -> list[str]:
    def ratio(a: str, b: str, index: int) -> str:
        if a not in rate or b not in rate:
            return "n/a (not run)"
        return f"{rate[a][index] / rate[b][index]:.2f}x"

    native = rows.get("fastdecode-native")
    return [
        f"- batch 1, native vs llama.cpp: {ratio('fastdecode-native', 'llama.cpp', 0)} (target >= 1.1x)",
        f"- batch 8, native vs CTranslate2 int8: {ratio('fastdecode-native', 'ct2-int8', 1)} (target >= 1.5x)",
        f"- prompt processing, native vs llama.cpp: {ratio('fastdecode-native', 'llama.cpp', 2)} (target >= 1x)",
        f"- load {native[1] if native else '?'} s (target <= 1 s), first token {native[2] if native else '?'} s "
        "after process start (target <= 1.5 s)",
        f"- float32 batch 1 vs CTranslate2 float32: {ratio('fastdecode-float32', 'ct2-float32', 0)} (target >= 1x)",
    ]


def bart_section(args) -> str:
    """bart-base size (random weights), 8 sources x 256 tokens, beam 4."""
    from random_models import build_bart

    folder = Path(tempfile.gettempdir()) / "fastdecode-bench" / "bart-base-random"
    if not (folder / "config.json").exists():
        build_bart().save_pretrained(folder)
    options = {"threads": args.threads, "first_prompt": list(range(3, 11)), "source": str(folder)}
    per_engine = {"fastdecode-int8": {"quantize": "int8"}, "fastdecode-float32": {}}
    ct2_dir = folder.parent / "bart-base-random-ct2"
    skipped = ""
    if available("ct2-bart") is None and not (ct2_dir / "model.bin").exists():
        import ctranslate2

        try:
            ctranslate2.converters.TransformersConverter(str(folder)).convert(str(ct2_dir), force=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a converter older than this transformers
            skipped = f"- CTranslate2 not run: its converter failed ({type(exc).__name__}: {exc})"
    if (ct2_dir / "model.bin").exists():
        vocab = ct2_dir / "id_to_token.json"
        if not vocab.exists():
            table = json.loads((ct2_dir / "shared_vocabulary.json").read_text())
            vocab.write_text(json.dumps(table))
        for compute in ("int8", "float32"):
            per_engine[f"ct2-{compute}"] = {"ct2_dir": str(ct2_dir), "compute_type": compute, "seq2seq": True,
                                            "vocab": str(vocab)}
    log_dir = Path(tempfile.mkdtemp(prefix="quantized-bart-"))
    workers = {name: Worker(name, {**options, **extra}, log_dir) for name, extra in per_engine.items()}
    sources = [[(7 * i + 13 * j) % 50000 + 4 for j in range(256)] for i in range(8)]
    new_tokens = 16 if args.quick else 64
    medians = run_rounds(workers, {"beam 4": {"prompts": sources, "new_tokens": new_tokens, "num_beams": 4}},
                         args.reps)
    for worker in workers.values():
        worker.close()
    base = medians.get("ct2-int8", {}).get("beam 4")
    lines = [f"## bart-base size (random weights), 8 x 256 source tokens, beam 4, {new_tokens} new tokens", "",
             "| engine | seconds | tokens/s | vs CTranslate2 int8 |", "|---|---|---|---|"]
    for name, m in medians.items():
        seconds = m["beam 4"]
        lines.append(f"| {name} | {seconds:.2f} | {8 * new_tokens / seconds:.1f} | "
                     f"{f'{base / seconds:.2f}x' if base else '-'} |")
    lines.append("- target: fastdecode int8 >= CTranslate2 int8")
    if skipped:
        lines.append(skipped)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker")
    parser.add_argument("--options")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--skip-bart", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--engines", help=f"comma-separated subset of {', '.join(ENGINES)}")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, json.loads(args.options))
        return
    print("Timings are wall-clock medians of alternating runs; on a shared machine compare the ratios.\n")
    if not args.skip_embedded:
        print(embedded_section(args), "\n", flush=True)
    if not args.skip_bart:
        print(bart_section(args), flush=True)


if __name__ == "__main__":
    main()
