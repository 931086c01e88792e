#!/usr/bin/env python
"""Concurrent beam search: beam groups in the one engine vs a code tree whose beams run one at a time.

Eight clients each send one beam-4 request at the same moment; reported: aggregate generated
tokens/s (every returned choice's tokens over the wall time from the first request to the last
answer), median with min-max over ``--reps``, and whether every answer equals the offline one.

* ``serve``: the embedded model behind ``fastdecode serve`` (text completions, n=2 choices each).
  Two servers run side by side, one from this tree, one from ``--baseline`` (e.g. /work/main, where
  beam requests run one at a time on a side thread), and take turns (A, B, A, B...). The offline
  answer is ``Generator.generate`` of this tree, one request at a time (a baseline whose offline
  arithmetic differs, e.g. one that folds a quantized model's beams, can differ from it).
* ``bart``: a bart-base-size random BART (``random_models.build_bart``) over sources of 64 tokens,
  in worker processes (token ids, no server: its random folder has no tokenizer). This tree: the 8
  requests submitted to one engine together. Baseline tree: the 8 requests one after the other
  through ``generate_ids_with_details``, as its server's beam thread runs them. The baseline's
  results are the offline answers.

    python benchmarks/concurrent_beams.py --baseline /work/main
    python benchmarks/concurrent_beams.py --baseline /work/main --quick
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness import median, spread, table

HERE = Path(__file__).resolve().parent
TREE = HERE.parent
TOPICS = ["the ocean", "a small town", "bread baking", "the moon landing", "chess openings", "rainforests",
          "jazz music", "the printing press"]


def prompts_for(clients: int) -> list[str]:
    return [f"Write a short story about {TOPICS[i % len(TOPICS)]}, with a twist at the end." for i in range(clients)]


def env_for(tree: Path) -> dict[str, str]:
    return harness.quiet_env(PYTHONPATH=f"{tree / 'src'}:{HERE}")


# -- serve -----------------------------------------------------------------------------------------
def start_server(tree: Path, port: int) -> subprocess.Popen:
    log = Path(tempfile.gettempdir()) / f"concurrent_beams-{port}.log"
    command = [sys.executable, "-m", "fastdecode.cli", "serve", "--port", str(port)]  # threads: OMP_NUM_THREADS
    return subprocess.Popen(command, cwd=tree, env=env_for(tree), stdout=log.open("w"), stderr=subprocess.STDOUT)


async def wait_ready(port: int, process: subprocess.Popen, timeout: float = 300.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server on port {port} exited ({process.returncode})")
            try:
                if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server on port {port} did not start")


async def burst(port: int, prompts: list[str], options: dict) -> tuple[float, int, list[list[str]]]:
    """Every prompt at once -> (seconds, generated tokens, each request's choice texts)."""
    import httpx

    async def one(client, prompt):
        body = {"prompt": prompt, "max_tokens": options["max_tokens"], "n": options["n"],
                "num_beams": options["beams"], "min_tokens": options["max_tokens"]}
        response = await client.post(f"http://127.0.0.1:{port}/v1/completions", json=body)
        response.raise_for_status()
        data = response.json()
        return data["usage"]["completion_tokens"], [c["text"] for c in data["choices"]]

    async with httpx.AsyncClient(timeout=3600) as client:
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - started
    return seconds, sum(tokens for tokens, _ in answers), [texts for _, texts in answers]


def offline_texts(prompts: list[str], options: dict, threads: int) -> list[list[str]]:
    code = ("import json, sys, torch, fastdecode\n"
            f"torch.set_num_threads({threads})\n"
            "gen = fastdecode.load()\n"
            "prompts, o = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
            "out = [gen.generate([p], max_new_tokens=o['max_tokens'], min_new_tokens=o['max_tokens'], "
            "num_beams=o['beams'], num_return_sequences=o['n']) for p in prompts]\n"
            "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", code, json.dumps(prompts), json.dumps(options)], env=env_for(TREE),
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_serve(args, baseline: Path) -> list[list]:
    prompts = prompts_for(args.clients)
    options = {"max_tokens": args.new_tokens, "n": 2, "beams": args.beams}
    trees = {"beam groups (this tree)": (TREE, 8731), f"beam thread ({baseline})": (baseline, 8732)}
    servers = {name: start_server(tree, port) for name, (tree, port) in trees.items()}
    try:
        for name, (_, port) in trees.items():
            asyncio.run(wait_ready(port, servers[name]))
        rates = {name: [] for name in trees}
        answers = {}
        for rep in range(args.reps):
            for name, (_, port) in (list(trees.items()) if rep % 2 == 0 else list(trees.items())[::-1]):
                seconds, tokens, texts = asyncio.run(burst(port, prompts, options))
                rates[name].append(tokens / seconds)
                answers.setdefault(name, texts)
                print(f"  serve rep {rep}: {name}: {tokens} tokens in {seconds:.1f} s", file=sys.stderr)
    finally:
        for process in servers.values():
            harness.stop_process(process)
    offline = offline_texts(prompts, options, args.threads)
    return rows_for("embedded SmolLM2-135M Q4_1, serve", rates, {n: same_count(a, offline) for n, a in answers.items()})


# -- bart --------------------------------------------------------------------------------------------
BART_WORKER = """
import json, sys, time, torch, fastdecode
torch.set_num_threads(int(sys.argv[3]))
gen = fastdecode.load(sys.argv[1])
job = json.loads(sys.argv[2])
sources, options, mode = job["sources"], job["options"], job["mode"]
warm = dict(options, max_new_tokens=2, min_new_tokens=2)
gen.generate_ids_with_details(sources[:1], **warm)  # first-call costs (kernels, allocator) out of the timing
engine = gen.engine() if mode == "engine" else None  # a server builds its engine once, before any request
if engine is not None:
    engine.submit(sources[0], warm)
    while engine.has_work():
        engine.step()
started = time.perf_counter()
if mode == "engine":
    roots = [engine.submit(s, options) for s in sources]
    while engine.has_work():
        engine.step()
    results = [[r.tokens for r in root.group.results] for root in roots]
else:
    results = [[r.tokens for r in gen.generate_ids_with_details([s], **options)] for s in sources]
seconds = time.perf_counter() - started
print(json.dumps({"seconds": seconds, "results": results}))
"""


def run_bart(args, baseline: Path) -> list[list]:
    import torch
    from random_models import build_bart, random_ids, saved_pair

    folder = Path(tempfile.mkdtemp(prefix="concurrent_beams_bart-"))
    hf, _ = saved_pair(build_bart, folder)
    sources = random_ids(args.clients, args.source_length, hf.config.vocab_size).tolist()
    del hf
    torch.set_num_threads(1)
    options = {"num_beams": args.beams, "num_return_sequences": 2, "max_new_tokens": args.new_tokens,
               "min_new_tokens": args.new_tokens}
    jobs = {"beam groups (this tree)": (TREE, "engine"), f"one at a time ({baseline})": (baseline, "serial")}
    rates = {name: [] for name in jobs}
    answers = {}
    for rep in range(args.reps):
        for name, (tree, mode) in (list(jobs.items()) if rep % 2 == 0 else list(jobs.items())[::-1]):
            job = json.dumps({"sources": sources, "options": options, "mode": mode})
            done = subprocess.run([sys.executable, "-c", BART_WORKER, str(folder), job, str(args.threads)],
                                  env=env_for(tree), capture_output=True, text=True, check=False)
            if done.returncode:
                raise RuntimeError(f"{name}: {done.stderr[-2000:]}")
            out = json.loads(done.stdout.strip().splitlines()[-1])
            tokens = sum(len(t) for result in out["results"] for t in result)
            rates[name].append(tokens / out["seconds"])
            answers.setdefault(name, out["results"])
            print(f"  bart rep {rep}: {name}: {tokens} tokens in {out['seconds']:.1f} s", file=sys.stderr)
    offline = answers[f"one at a time ({baseline})"]
    return rows_for("bart-base-size random BART, Engine", rates, {n: same_count(a, offline) for n, a in answers.items()})


def same_count(answers: list, offline: list) -> str:
    """How many requests answered exactly as offline (every choice), of all."""
    return f"{sum(a == b for a, b in zip(answers, offline))}/{len(offline)}"


def rows_for(model: str, rates: dict[str, list[float]], same: dict[str, str]) -> list[list]:
    names = list(rates)
    base = median(rates[names[1]])
    return [[model, name, spread(r), f"{median(r) / base:.2f}x", same[name]] for name, r in rates.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", type=Path, required=True, help="a fastdecode tree whose beams run one at a time")
    parser.add_argument("--models", default="serve,bart")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--source-length", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="2 clients, 8 new tokens, one repetition")
    args = parser.parse_args()
    if args.quick:
        args.clients, args.new_tokens, args.reps = 2, 8, 1
    wanted = args.models.split(",")
    contention = harness.Contention()
    rows = (run_serve(args, args.baseline) if "serve" in wanted else []) + (
        run_bart(args, args.baseline) if "bart" in wanted else [])
    print(harness.machine_line(args.threads))
    print(f"{args.clients} concurrent requests, beam {args.beams}, {args.new_tokens} new tokens each "
          f"(min_tokens = max_tokens), 2 choices each; {args.reps} alternating repetitions")
    print(table(["model", "engine", "aggregate tokens/s, median (min-max)", "vs baseline", "requests as offline"], rows))
    print(f"other processes (and the servers) kept {contention.other_cores():.1f} cores busy on average")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
