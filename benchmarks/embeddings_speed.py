"""Embeddings through the server: texts/s for 256 inputs of 64 tokens each on POST /v1/embeddings,
fastdecode serve --embeddings against llama.cpp's llama-server --embeddings on the same GGUF file
(the embedded SmolLM2-135M Q4_1 by default; mean pooling, L2-normalized), side by side.

The inputs are seeded random token-id lists (the same for both servers, sent as ids, so both embed
exactly the same tokens), ``--batch`` inputs per request with ``--clients`` requests in flight.
Both servers run at once with ``--threads`` threads each (fastdecode: ``OMP_NUM_THREADS``;
llama-server: ``-t`` / ``-tb``, one slot per input in flight, batches of up to ``--max-batch-tokens``
tokens as fastdecode's steps); each gets one warm-up request, then they alternate, one timed run of
all the inputs each per repetition (the order flips every repetition, so drift in the machine's load
hits both alike), while the other sits idle. Reported: the median seconds and texts/s with their
range, the ratio within each repetition, the cores other processes kept busy meanwhile, and the
agreement of the two servers' vectors (cosine similarity of each input's two embeddings). A server
that cannot be started is reported as NOT RUN, never estimated.

    python benchmarks/embeddings_speed.py                     # llama.cpp from --llama-cpp-bin / $LLAMA_CPP_BIN
    python benchmarks/embeddings_speed.py --llama-cpp-bin ~/.cache/fastdecode-bench/llama.cpp/hybrid/bin
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import Contention, median, not_run, spread, table
from peers import llama_cpp
from serve_load import Server

TEXTS, TOKENS = 256, 64


def inputs(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(TOKENS)] for _ in range(TEXTS)]


async def embed_all(server: Server, data: list[list[int]], batch: int, clients: int) -> tuple[float, list[list[float]]]:
    """(seconds to embed every input with ``clients`` requests of ``batch`` inputs in flight, the vectors)."""
    chunks = list(enumerate(data[i : i + batch] for i in range(0, len(data), batch)))
    vectors: list[list[float]] = [[] for _ in data]
    async with httpx.AsyncClient(base_url=server.base, timeout=900) as client:
        async def worker() -> None:
            while chunks:
                number, chunk = chunks.pop(0)
                response = await client.post("/v1/embeddings", json={"model": server.model, "input": chunk,
                                                                      "encoding_format": "float"})
                response.raise_for_status()
                rows = sorted(response.json()["data"], key=lambda row: row["index"])
                assert len(rows) == len(chunk), (server.name, len(rows), len(chunk))
                for offset, row in enumerate(rows):
                    vectors[number * batch + offset] = row["embedding"]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return time.perf_counter() - started, vectors


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_run(server: Server, data: list[list[int]], args) -> dict:
    meter, server_cpu, own_cpu = Contention(), cpu_seconds(server.process.pid), harness.cpu_seconds()
    seconds, vectors = asyncio.run(embed_all(server, data, args.batch, args.clients))
    used = cpu_seconds(server.process.pid) - server_cpu + harness.cpu_seconds() - own_cpu
    return {"seconds": seconds, "vectors": vectors, "other_cores": meter.other_cores(used)}


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)  # [N, C] each
    return ((x * y).sum(axis=1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))).tolist()


def start(args, gguf: Path) -> tuple[list[Server], dict[str, str]]:
    servers, skipped = [], {}
    threads = str(args.threads)
    for name in args.servers.split(","):
        port = llama_cpp.free_port()
        if name == "fastdecode":
            command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(gguf), "--port", str(port),
                       "--model-name", "smollm2", "--embeddings", "--pooling", "mean",
                       "--max-batch-tokens", str(args.max_batch_tokens), "--max-queue", "1024"]
            servers.append(Server(name, command, port, "smollm2", "Q4_1 natively",
                                  env={"OMP_NUM_THREADS": threads}))
        elif name == "llama.cpp":
            exe, why = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
            if exe is None:
                skipped[name] = why
                continue
            slots = args.llama_cpp_slots or args.batch * args.clients  # default: every input in flight has a slot
            ubatch = args.llama_cpp_ubatch or args.max_batch_tokens
            command = [str(exe), "-m", str(gguf), "--port", str(port), "-t", threads, "-tb", threads,
                       "--embeddings", "--pooling", "mean", "-np", str(slots), "-c", str(slots * 2 * TOKENS),
                       "-b", str(args.max_batch_tokens), "-ub", str(ubatch), "--no-webui"]
            servers.append(Server(name, command, port, "smollm2", "Q4_1 natively"))
        else:
            raise SystemExit(f"unknown server {name!r}: fastdecode or llama.cpp")
    for server in list(servers):
        if not server.wait_ready(300):
            skipped[server.name] = f"did not start (log: {server.log})"
            server.stop()
            servers.remove(server)
    return servers, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32, help="inputs per request")
    parser.add_argument("--clients", type=int, default=2, help="requests in flight")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per forward, both servers")
    parser.add_argument("--llama-cpp-slots", type=int, default=None,
                        help="llama-server's -np (default: --batch x --clients, one slot per input in flight)")
    parser.add_argument("--llama-cpp-ubatch", type=int, default=None,
                        help="llama-server's -ub (default: --max-batch-tokens; its attention in one ubatch spans "
                             "every sequence in it, so smaller ubatches cost it less attention)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="fastdecode,llama.cpp")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help=f"llama.cpp's binaries (default: $LLAMA_CPP_BIN or {llama_cpp.DEFAULT_BIN})")
    parser.add_argument("--wait-for-quiet", type=float, default=0.0,
                        help="before each timed run wait up to this many seconds for other processes to quiet down")
    args = parser.parse_args()
    gguf = harness.embedded_model_path()
    from fastdecode.loading.gguf_file import GGUFFile

    data = inputs(len(GGUFFile(gguf).metadata["tokenizer.ggml.tokens"]))
    servers, skipped = start(args, gguf)
    runs: dict[str, list[dict]] = {server.name: [] for server in servers}
    try:
        for server in servers:
            asyncio.run(embed_all(server, data[: args.batch], args.batch, 1))  # warm-up
        for rep in range(args.reps):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                harness.wait_for_quiet(args.wait_for_quiet)
                runs[server.name].append(timed_run(server, data, args))
                print(f"  rep {rep + 1}/{args.reps} {server.name:<10} {runs[server.name][-1]['seconds']:.2f} s",
                      file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.stop()
    print(report(runs, skipped, args))


def report(runs: dict[str, list[dict]], skipped: dict[str, str], args) -> str:
    rows = []
    ours, theirs = runs.get("fastdecode", []), runs.get("llama.cpp", [])
    for name, results in runs.items():
        seconds = [r["seconds"] for r in results]
        rows.append([name, "Q4_1 natively", spread(seconds, 2), spread([TEXTS / s for s in seconds], 1)])
    rows += [not_run(name, why, 4) for name, why in skipped.items()]
    lines = [harness.machine_line(args.threads), "",
             f"{TEXTS} texts x {TOKENS} tokens (token ids), {args.batch} per request, {args.clients} in flight, "
             f"{args.threads} threads each, {args.reps} alternating reps: median (min-max); llama-server "
             f"-np {args.llama_cpp_slots or args.batch * args.clients} -b {args.max_batch_tokens} "
             f"-ub {args.llama_cpp_ubatch or args.max_batch_tokens}, fastdecode --max-batch-tokens "
             f"{args.max_batch_tokens}", "",
             table(["server", "weights", "seconds", "texts/s"], rows)]
    if ours and theirs:
        paired = [b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)]  # texts/s ratio, run back to back
        agreement = cosines(ours[-1]["vectors"], theirs[-1]["vectors"])
        lines += ["", f"fastdecode / llama.cpp texts/s: {spread(paired, 2)}x (each repetition's pair)",
                  f"cosine similarity of each text's two embeddings: min {min(agreement):.6f}, "
                  f"median {median(agreement):.6f} ({len(agreement)} texts)"]
    busy = [r["other_cores"] for results in runs.values() for r in results]
    if busy:
        lines.append(f"other processes kept {median(busy):.1f} cores busy (median; max {max(busy):.1f}) "
                     "during the timed runs")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
