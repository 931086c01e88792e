"""Serving throughput on the embedded SmolLM2-135M: static batches vs continuous batching (the engine) vs
transformers' continuous batching, on one mixed workload.

    python benchmarks/serving_throughput.py                       # 64 requests, prompts 8-400, outputs 8-256
    python benchmarks/serving_throughput.py --requests 16 --max-prompt 160 --max-output 48   # a quick look

Workload (fixed seed): ``--requests`` requests, prompt lengths uniform in [8, max-prompt] and
output lengths uniform in [8, max-output] (EOS disabled, so every request produces exactly its
length), either all submitted at once or arriving as a Poisson process of ``--rate`` requests/s.

* static: batches of 8 in arrival order through ``Generator.engine()``; a batch starts when its last
  request has arrived and the previous batch is done, and every row runs until the batch's longest
  output is done (shorter rows' extra tokens are waste), as a static batch does.
* engine: ``Generator.engine()``: requests are submitted when they arrive and join the running
  batch at the next step (chunked prefill mixed with decode).
* transformers: transformers' ``ContinuousBatchingManager`` (``init_continuous_batching``) on the
  same GGUF weights (dequantized to float32), requests added as they arrive.

Reported per variant and arrival pattern: requests/s, output tokens/s, p50/p99 time to first
token (from arrival) and per-token latency (time between a request's tokens). Variants run one
after another in this process, ``--rounds`` times alternating; the table shows medians. The
machine this was written on was shared with other jobs: compare ratios within one run only.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from harness import embedded_model_path, median, percentile, table

STATIC_BATCH = 8


def workload(args, poisson: bool) -> list[tuple[float, list[int], int]]:
    """[(arrival seconds, prompt ids, output length)] in arrival order, from a fixed seed."""
    rng = random.Random(args.seed)
    requests, clock = [], 0.0
    for _ in range(args.requests):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(8, args.max_prompt))]
        requests.append((clock if poisson else 0.0, prompt, rng.randint(8, args.max_output)))
        clock += rng.expovariate(args.rate)
    return requests


def wait_until(start: float, moment: float) -> None:
    delay = start + moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_static(gen, requests) -> list[list[float]]:
    """Token timestamps per request (seconds from the start)."""
    # a budget that admits a whole batch's prompts in one step, as one left-padded batch would
    engine = gen.engine(max_batch_tokens=STATIC_BATCH * max(len(r[1]) for r in requests), max_queue=STATIC_BATCH)
    start, stamps = time.perf_counter(), [[] for _ in requests]
    for first in range(0, len(requests), STATIC_BATCH):
        batch = list(range(first, min(first + STATIC_BATCH, len(requests))))
        wait_until(start, max(requests[i][0] for i in batch))
        longest = max(requests[i][2] for i in batch)
        index_of = {engine.submit(requests[i][1], {"max_new_tokens": longest, "eos_token_id": []}).id: i
                    for i in batch}
        while engine.has_work():
            events = engine.step()
            now = time.perf_counter() - start
            for event in events:
                index = index_of[event.sequence.id]
                if len(stamps[index]) < requests[index][2]:
                    stamps[index].append(now)
    return stamps


def run_engine(gen, requests, max_batch_tokens: int) -> list[list[float]]:
    engine = gen.engine(max_batch_tokens=max_batch_tokens, max_queue=len(requests))
    start, stamps, submitted, index_of = time.perf_counter(), [[] for _ in requests], 0, {}
    while submitted < len(requests) or engine.has_work():
        now = time.perf_counter() - start
        while submitted < len(requests) and requests[submitted][0] <= now:
            _, prompt, length = requests[submitted]
            sequence = engine.submit(prompt, {"max_new_tokens": length, "eos_token_id": []})
            index_of[sequence.id] = submitted
            submitted += 1
        if not engine.has_work():
            wait_until(start, requests[submitted][0])
            continue
        events = engine.step()
        now = time.perf_counter() - start
        for event in events:
            stamps[index_of[event.sequence.id]].append(now)
    return stamps


def run_transformers(model, requests, max_batch_tokens: int) -> list[list[float]]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r[2] for r in requests), eos_token_id=None,
                              pad_token_id=0)
    # Sized like the engine's cache (left alone it sizes itself from free memory: 14 GB here, OOM-killed).
    needed = sum(len(prompt) + length for _, prompt, length in requests)
    batching = ContinuousBatchingConfig(page_size=16, num_blocks=-(-needed // 16) + len(requests),
                                        max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=config, continuous_batching_config=batching)
    manager.start()
    start, ids = time.perf_counter(), []
    try:
        for index, (arrival, prompt, length) in enumerate(requests):
            wait_until(start, arrival)
            ids.append(manager.add_request(prompt, request_id=f"r{index}", max_new_tokens=length,
                                           record_timestamps=True))
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1.0)
            if out is not None and out.status.name == "FINISHED":
                results[out.request_id] = out
    finally:
        manager.stop(block=True)
    return [[t - start for t in results[i].timestamps] for i in ids]  # perf_counter readings


def summarize(requests, stamps) -> dict[str, float]:
    wall = max(s[-1] for s in stamps)
    ttft = [s[0] - r[0] for r, s in zip(requests, stamps)]
    per_token = [(s[-1] - s[0]) / (len(s) - 1) for s in stamps if len(s) > 1]
    tokens = sum(len(s) for s in stamps)
    assert all(len(s) == r[2] for r, s in zip(requests, stamps)), "a request got a wrong number of tokens"

    return {"req_s": len(requests) / wall, "tok_s": tokens / wall, "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "tpot_p50": percentile(per_token, 50),
            "tpot_p99": percentile(per_token, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=400)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import fastdecode

    gen = fastdecode.load(None)
    variants = {"static": lambda r: run_static(gen, r), "engine": lambda r: run_engine(gen, r, args.max_batch_tokens)}
    if not args.skip_transformers:
        from transformers import AutoModelForCausalLM

        path = embedded_model_path()
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        variants["transformers"] = lambda r: run_transformers(hf, r, args.max_batch_tokens)
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for _ in range(args.rounds):
        for pattern in ("all at once", "poisson"):
            requests = workload(args, pattern == "poisson")
            for name, run in variants.items():
                with torch.inference_mode():
                    results.setdefault((pattern, name), []).append(summarize(requests, run(requests)))
                print(f"done: {pattern} / {name}", file=sys.stderr, flush=True)
    rows = []
    for (pattern, name), runs in results.items():
        med = {k: median(r[k] for r in runs) for k in runs[0]}
        base = median(r["tok_s"] for r in results[(pattern, "static")])
        rows.append([pattern, name, f"{med['req_s']:.2f}", f"{med['tok_s']:.1f}", f"{med['tok_s'] / base:.2f}x",
                     f"{med['ttft_p50']:.2f}", f"{med['ttft_p99']:.2f}", f"{med['tpot_p50'] * 1000:.0f}",
                     f"{med['tpot_p99'] * 1000:.0f}"])
    print(f"{args.requests} requests, prompts 8-{args.max_prompt}, outputs 8-{args.max_output}, "
          f"Poisson rate {args.rate}/s, {args.rounds} round(s), {args.threads} torch thread(s)")
    print(table(["arrivals", "variant", "req/s", "out tok/s", "vs static", "TTFT p50 s", "TTFT p99 s",
                 "per-token p50 ms", "per-token p99 ms"], rows))


if __name__ == "__main__":
    main()
