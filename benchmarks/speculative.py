"""Speculative decoding against plain decoding, and against llama.cpp's, side by side in one run.

    python benchmarks/speculative.py [--model PATH] [--draft-model PATH] [--new-tokens 128] [--reps 2]
                                     [--threads 2] [--batch 1 8] [--workloads a b c]
                                     [--llama-cpp-bin DIR] [--llama-spec ngram-simple ngram-map-k ...]

Workloads (chat prompts on the model's template): (a) summarize a ~1,000-token document, (b) apply a
small edit to a 60-line code file and return the whole file, (c) open-ended chat. Each job runs
greedy with ``speculative=None``, ``speculative="ngram"`` and, with ``--draft-model``, the draft
model, alternating in every repetition; outputs must be identical (the script fails otherwise).
Like llama.cpp's runs, every run ignores EOS and
generates ``--new-tokens`` (Qwen2.5-Coder-1.5B ends job (b) after ~30 tokens: it returns only the
renamed function). Decode tokens/s counts the tokens after the first one over the time after the first step (the prompt
excluded); "CPU ms / token" is fastdecode's process CPU time over the same tokens (a shared machine's
load inflates it far less than wall time); "accepted / verify" is the mean number of draft tokens accepted
per verifying step, "acceptance" the share of drafted tokens accepted. Batch 8: eight such requests
(different documents / files) submitted at once.

llama.cpp (optional: its ``llama-server`` from ``--llama-cpp-bin`` / $LLAMA_CPP_BIN / the build
script's cache; without it those rows say NOT RUN): one server per setting on the same GGUF with one
slot per request of the largest batch, ``-t`` = ``--threads``: without speculation, each
``--llama-spec`` entry (``--spec-type`` and its value, more flags after it, e.g. "ngram-simple
--spec-ngram-simple-size-n 4"), and with ``--draft-model`` the same draft file (``-md``, ``--spec-type
draft-simple``). The prompts go as token ids, greedy, EOS ignored, ``--new-tokens`` each, in the same
repetitions as fastdecode's jobs. Its decode tokens/s is llama-server's own count: the tokens after
the first over its generation time (the slowest request's at batch 8); acceptance from its
``draft_n_accepted / draft_n``. "vs llama.cpp best" divides fastdecode's best speculative decode rate
by llama.cpp's best speculative one on the same job.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
from peers import llama_cpp  # noqa: E402

# llama-server's n-gram modes as they come (12-token lookups, 48-token drafts) and with short lookups and
# 8-token drafts (a small model's verify rows are not free)
SHORT = "--spec-ngram-{0}-size-n 3 --spec-ngram-{0}-size-m 8"
DEFAULT_LLAMA_SPEC = ["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache", "ngram-simple " + SHORT.format("simple"),
                      "ngram-map-k " + SHORT.format("map-k")]
TOPICS = ["lighthouses", "bread baking", "river deltas", "chess openings", "glaciers", "bees", "railways", "tides"]


def document(topic: str, sentences: int = 24) -> str:
    """A plain, repetitive-enough report of ~1,000 tokens about ``topic``."""
    facts = [f"Section {i + 1} of the report on {topic} notes that observation {i} was recorded on day {3 * i + 1}, "
             f"when the team measured a value of {17 * i % 97} units and compared it with the previous season."
             for i in range(sentences)]
    return " ".join(facts)


def code_file(variant: int, functions: int = 20) -> str:
    lines = [f"def function_{i}(x):\n    return x * {i + variant} + {i * i}" for i in range(functions)]
    lines += [f"CONSTANT_{i} = {i * 7 + variant}" for i in range(60 - 2 * functions)]
    return "\n".join(lines)


def workloads(variant: int) -> dict[str, list[dict[str, str]]]:
    topic = TOPICS[variant % len(TOPICS)]
    return {
        "(a) summarize 1k-token doc": [{"role": "user", "content": document(topic) + "\n\nSummarize the report above "
                                        "section by section, quoting each section's figures."}],
        "(b) edit 60-line file": [{"role": "user", "content": "Rename function_3 to triple_plus_nine and return the "
                                   "whole file, unchanged otherwise:\n\n" + code_file(variant)}],
        "(c) open-ended chat": [{"role": "user", "content": f"Write a short story about {topic}."}],
    }


def run_batch(gen, prompts: list[list[int]], new_tokens: int, speculative) -> dict:
    """Submit every prompt at once, step to the end -> outputs, decode seconds, tokens, drafts."""
    engine = gen.engine()
    options = {"max_new_tokens": new_tokens, "ignore_eos": True, "speculative": speculative}  # as llama.cpp's runs
    sequences = [engine.submit(p, options) for p in prompts]
    started = time.perf_counter()
    while not all(s.output_ids for s in sequences):  # the prompts and the first token
        engine.step()
    first, first_cpu = time.perf_counter(), time.process_time()
    counted = sum(len(s.output_ids) for s in sequences)
    while engine.has_work():
        engine.step()
    end, end_cpu = time.perf_counter(), time.process_time()
    spec = [s.speculation for s in sequences if s.speculation is not None]
    return {"outputs": [s.output_ids for s in sequences], "decode_s": end - first, "total_s": end - started,
            "decode_cpu_s": end_cpu - first_cpu,
            "decode_tokens": sum(len(s.output_ids) for s in sequences) - counted,
            "drafted": sum(x.drafted for x in spec), "accepted": sum(x.accepted for x in spec),
            "verify_steps": sum(x.verify_steps for x in spec)}


def fastdecode_row(result: dict) -> dict:
    return {"tok_s": result["decode_tokens"] / max(result["decode_s"], 1e-9),
            "cpu_ms": 1000 * result["decode_cpu_s"] / max(result["decode_tokens"], 1),
            "per_verify": result["accepted"] / max(result["verify_steps"], 1) if result["verify_steps"] else None,
            "acceptance": result["accepted"] / result["drafted"] if result["drafted"] else None}


def llama_row(peer: llama_cpp.ServerPeer, prompts: list[list[int]], new_tokens: int) -> dict:
    answers, _ = peer.completions(prompts, new_tokens)  # (its CPU time covers the prompt too: not shown)
    timings = [answer["timings"] for answer in answers]
    tokens = sum(t["predicted_n"] - 1 for t in timings)
    seconds = max(t["predicted_ms"] for t in timings) / 1000
    drafted = sum(t.get("draft_n", 0) for t in timings)
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    return {"tok_s": tokens / max(seconds, 1e-9), "cpu_ms": None, "per_verify": None,
            "acceptance": accepted / drafted if drafted else None}


def llama_servers(args, gguf: Path, prompts: list[list[int]], context: int) -> tuple[dict, str | None]:
    """name -> a started llama-server per setting, or ({}, why none runs)."""
    binary, why_not = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
    if binary is None:
        return {}, why_not
    settings: dict[str, tuple[str, ...]] = {"llama.cpp": ()}
    for entry in args.llama_spec:
        spec_type, *more = entry.split()
        settings[f"llama.cpp {entry}"] = ("--spec-type", spec_type, *more)
    if args.draft_model:
        settings["llama.cpp draft (-md)"] = ("--spec-type", "draft-simple", "-md", args.draft_model,
                                             "--spec-draft-n-max", str(args.llama_draft_max))
    servers = {}
    for name, extra in settings.items():
        print(f"  starting {name}", file=sys.stderr)
        try:
            servers[name] = llama_cpp.ServerPeer(binary, gguf, args.threads, prompts[0][:16],
                                                 parallel=max(args.batch), context_per_slot=context, extra=extra)
        except RuntimeError as error:  # e.g. a build without these --spec-type values
            for peer in servers.values():
                peer.close()
            return {}, f"{binary} {' '.join(extra)}: {error}"
    return servers, None


def cell(values: list[float], digits: int = 1) -> str:
    return harness.spread(values, digits) if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer")
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c"])
    parser.add_argument("--llama-cpp-bin", default=None,
                        help=f"llama.cpp's binaries (default: $LLAMA_CPP_BIN or {llama_cpp.DEFAULT_BIN})")
    parser.add_argument("--llama-spec", nargs="*", default=DEFAULT_LLAMA_SPEC,
                        help="llama-server speculative settings to run: a --spec-type value, more flags after it")
    parser.add_argument("--llama-draft-max", type=int, default=4, help="llama-server's --spec-draft-n-max with -md")
    parser.add_argument("--no-llama-cpp", action="store_true", help="fastdecode only")
    args = parser.parse_args()
    import torch

    import fastdecode

    torch.set_num_threads(args.threads)
    gen = fastdecode.load(args.model)
    print(harness.machine_line(args.threads))
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct Q4_1'}; greedy, {args.new_tokens} new tokens at most\n")
    engines = {"fastdecode": None, "fastdecode ngram": "ngram"}
    if args.draft_model:
        engines["fastdecode draft"] = {"draft_model": args.draft_model}
        gen.requests.draft_model(args.draft_model, gen.model.kernels)  # loaded before timing
    jobs = {(batch, name): [gen.encode_prompt(workloads(v)[name], chat=True) for v in range(batch)]
            for batch in args.batch for name in workloads(0) if name[1] in args.workloads}
    longest = max(len(p) for prompts in jobs.values() for p in prompts)
    servers, why_not = ({}, "--no-llama-cpp") if args.no_llama_cpp else llama_servers(
        args, Path(args.model) if args.model else harness.embedded_model_path(), next(iter(jobs.values())),
        longest + args.new_tokens + 64)
    rows, summary = [], []
    try:
        for (batch, name), prompts in jobs.items():
            measured: dict[str, list[dict]] = {engine: [] for engine in [*engines, *servers]}
            outputs = {}
            for _ in range(args.reps):  # every engine once per repetition, in turn
                for engine, speculative in engines.items():
                    result = run_batch(gen, prompts, args.new_tokens, speculative)
                    outputs[engine] = result["outputs"]
                    measured[engine].append(fastdecode_row(result))
                    print(f"  batch {batch} {name} {engine}: {measured[engine][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
                for engine, peer in servers.items():
                    measured[engine].append(llama_row(peer, prompts, args.new_tokens))
                    print(f"  batch {batch} {name} {engine}: {measured[engine][-1]['tok_s']:.1f} tok/s", file=sys.stderr)
            for engine in engines:
                if outputs[engine] != outputs["fastdecode"]:
                    raise SystemExit(f"{engine} outputs differ on {name} (batch {batch}): speculation must not "
                                     "change them")
            rate = {engine: harness.median(m["tok_s"] for m in runs) for engine, runs in measured.items()}
            for engine, runs in measured.items():
                last = runs[-1]
                rows.append([batch, name, engine, cell([m["tok_s"] for m in runs]),
                             harness.fmt_ratio(harness.ratio(rate[engine], rate["fastdecode"])),
                             cell([m["cpu_ms"] for m in runs if m["cpu_ms"] is not None], 2),
                             "-" if last["per_verify"] is None else f"{last['per_verify']:.2f}",
                             "-" if last["acceptance"] is None else f"{last['acceptance']:.0%}"])
            ours = max((e for e in engines if e != "fastdecode"), key=rate.get)
            theirs = [e for e in servers if e != "llama.cpp"]
            best = max(theirs, key=rate.get) if theirs else None
            summary.append([batch, name, f"{ours} {rate[ours]:.1f}", harness.fmt_ratio(
                harness.ratio(rate[ours], rate["fastdecode"])),
                f"{best} {rate[best]:.1f}" if best else f"NOT RUN ({why_not})",
                harness.fmt_ratio(harness.ratio(rate[ours], rate[best])) if best else "-"])
    finally:
        for peer in servers.values():
            peer.close()
    print(harness.table(["batch", "workload", "engine", "decode tok/s", "vs fastdecode plain", "CPU ms / token",
                         "accepted / verify", "acceptance"], rows))
    print()
    print(harness.table(["batch", "workload", "fastdecode best speculative tok/s", "vs fastdecode plain",
                         "llama.cpp best speculative tok/s", "fastdecode / llama.cpp best"], summary))
    if why_not:
        print(f"\nllama.cpp: NOT RUN ({why_not})")


if __name__ == "__main__":
    main()
