"""Embeddings through the server: sequences/s for 256 inputs of 64 tokens each on POST /v1/embeddings,
fastdecode serve --embeddings against llama.cpp's llama-server --embeddings on the same GGUF file
(mean pooling, normalized), side by side.

The inputs are seeded random token-id lists (the same for both servers), sent as ``--batch``
inputs per request with ``--clients`` requests in flight; each server gets one warm-up request,
then ``--reps`` timed runs (median reported). A server that cannot be started is reported as such,
never estimated.

    python benchmarks/embeddings_speed.py                     # the embedded SmolLM2-135M Q4_1 GGUF
    python benchmarks/embeddings_speed.py --llama-cpp-bin /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import httpx

import harness
from harness import median, not_run, table
from peers import llama_cpp
from serve_load import Server

TEXTS, TOKENS = 256, 64


def inputs(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(TOKENS)] for _ in range(TEXTS)]


async def run_once(server: Server, data: list[list[int]], batch: int, clients: int) -> float:
    """Seconds to embed every input (``clients`` requests of ``batch`` inputs in flight)."""
    chunks = [data[i : i + batch] for i in range(0, len(data), batch)]
    queue = list(chunks)
    async with httpx.AsyncClient(base_url=server.base, timeout=600) as client:
        async def worker() -> None:
            while queue:
                chunk = queue.pop()
                response = await client.post("/v1/embeddings", json={"model": server.model, "input": chunk,
                                                                      "encoding_format": "float"})
                response.raise_for_status()
                assert len(response.json()["data"]) == len(chunk)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=harness.cpu_count())
    parser.add_argument("--batch", type=int, default=32, help="inputs per request")
    parser.add_argument("--clients", type=int, default=2, help="requests in flight")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="fastdecode,llama.cpp")
    parser.add_argument("--llama-cpp-bin", default=None)
    args = parser.parse_args()
    gguf = harness.embedded_model_path()
    from fastdecode.loading.gguf_file import GGUFFile

    vocab = len(GGUFFile(gguf).metadata["tokenizer.ggml.tokens"])
    data = inputs(vocab)
    rows, servers = [], []
    for name in args.servers.split(","):
        port = llama_cpp.free_port()
        if name == "fastdecode":
            command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(gguf), "--port", str(port),
                       "--model-name", "smollm2", "--embeddings", "--pooling", "mean",
                       "--max-batch-tokens", str(args.batch * TOKENS)]
            servers.append(Server(name, command, port, "smollm2", "Q4_1 natively", env={"OMP_NUM_THREADS": str(args.threads)}))
        elif name == "llama.cpp":
            exe, why = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
            if exe is None:
                rows.append(not_run(name, why, 4))
                continue
            command = [str(exe), "-m", str(gguf), "--port", str(port), "-t", str(args.threads), "--embeddings",
                       "--pooling", "mean", "-c", str(args.batch * TOKENS), "-b", str(args.batch * TOKENS),
                       "-ub", str(args.batch * TOKENS), "-np", str(args.clients), "--no-webui"]
            servers.append(Server(name, command, port, "smollm2", "Q4_1 natively"))
    for server in servers:
        if not server.wait_ready(120):
            rows.append(not_run(server.name, f"did not start (log: {server.log})", 4))
            server.stop()
            continue
        try:
            asyncio.run(run_once(server, data[: args.batch], args.batch, 1))  # warm-up
            seconds = [asyncio.run(run_once(server, data, args.batch, args.clients)) for _ in range(args.reps)]
            rows.append([server.name, server.weights, f"{median(seconds):.2f}", f"{TEXTS / median(seconds):.1f}"])
        finally:
            server.stop()
    print(harness.machine_line(args.threads))
    print(f"{TEXTS} inputs x {TOKENS} tokens, {args.batch} per request, {args.clients} in flight, median of {args.reps}")
    print(table(["server", "weights", "seconds", "sequences/s"], rows))


if __name__ == "__main__":
    main()
