"""Speculative decoding (prompt lookup) against plain decoding, side by side in one process.

    python benchmarks/speculative.py [--model PATH] [--draft-model PATH] [--new-tokens 256] [--reps 2]
                                     [--threads 2] [--batch 1 8]

Workloads (chat prompts on the model's template): (a) summarize a ~1,000-token document, (b) apply a
small edit to a 60-line code file and return the whole file, (c) open-ended chat. Each job runs
greedy with ``speculative=None``, ``speculative="ngram"`` and, with ``--draft-model``, the draft
model, alternating in every repetition;
outputs must be identical (the script fails otherwise). Decode tokens/s counts the tokens after
the first one over the time after the first step (the prompt excluded); "accepted / verify" is the
mean number of draft tokens accepted per verifying step, "acceptance" the share of drafted tokens
accepted. Batch 8: eight such requests (different documents / files) submitted at once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

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
    sequences = [engine.submit(p, {"max_new_tokens": new_tokens, "speculative": speculative}) for p in prompts]
    started = time.perf_counter()
    while not all(s.output_ids for s in sequences):  # the prompts and the first token
        engine.step()
    first = time.perf_counter()
    counted = sum(len(s.output_ids) for s in sequences)
    while engine.has_work():
        engine.step()
    end = time.perf_counter()
    spec = [s.speculation for s in sequences if s.speculation is not None]
    return {"outputs": [s.output_ids for s in sequences], "decode_s": end - first, "total_s": end - started,
            "decode_tokens": sum(len(s.output_ids) for s in sequences) - counted,
            "drafted": sum(x.drafted for x in spec), "accepted": sum(x.accepted for x in spec),
            "verify_steps": sum(x.verify_steps for x in spec)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF or HF folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer")
    parser.add_argument("--workloads", nargs="+", default=["a", "b", "c"])
    args = parser.parse_args()
    import torch

    import fastdecode

    torch.set_num_threads(args.threads)
    gen = fastdecode.load(args.model)
    print(harness.machine_line(args.threads))
    print(f"model: {args.model or 'embedded SmolLM2-135M-Instruct Q4_1'}; greedy, {args.new_tokens} new tokens at most\n")
    engines = {"plain": None, "ngram": "ngram"}
    if args.draft_model:
        engines["draft"] = {"draft_model": args.draft_model}
        gen.requests.draft_model(args.draft_model)  # loaded before timing
    rows = []
    for batch in args.batch:
        for name in workloads(0):
            if name[1] not in args.workloads:
                continue
            prompts = [gen.encode_prompt(workloads(v)[name], chat=True) for v in range(batch)]
            rates: dict[str, list[float]] = {engine: [] for engine in engines}
            results = {}
            for _ in range(args.reps):
                for engine, speculative in engines.items():
                    results[engine] = run_batch(gen, prompts, args.new_tokens, speculative)
                    r = results[engine]
                    rates[engine].append(r["decode_tokens"] / max(r["decode_s"], 1e-9))
                    print(f"  batch {batch} {name} {engine}: {rates[engine][-1]:.1f} tok/s", file=sys.stderr)
            for engine in engines:
                if results[engine]["outputs"] != results["plain"]["outputs"]:
                    raise SystemExit(f"{engine} outputs differ on {name} (batch {batch}): speculation must not "
                                     "change them")
                if engine == "plain":
                    continue
                spec = results[engine]
                rows.append([batch, name, engine, len(prompts[0]), round(spec["decode_tokens"] / batch + 1),
                             harness.spread(rates["plain"]), harness.spread(rates[engine]),
                             harness.fmt_ratio(harness.ratio(harness.median(rates[engine]),
                                                             harness.median(rates["plain"]))),
                             f"{spec['accepted'] / max(spec['verify_steps'], 1):.2f}",
                             f"{spec['accepted'] / max(spec['drafted'], 1):.0%}"])
    print(harness.table(["batch", "workload", "drafter", "prompt tokens", "new tokens", "plain decode tok/s",
                         "speculative decode tok/s", "speed-up", "accepted / verify", "acceptance"], rows))


if __name__ == "__main__":
    main()
