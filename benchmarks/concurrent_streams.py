"""Concurrent conversations past the context through ``fastdecode serve``: A/B of two source trees.

``--clients`` (default 8) chat requests at once, each needing more than ``--n-ctx`` positions
(prompt + ``--max-tokens``, EOS ignored, greedy), to a server started with ``--n-ctx N
--context-overflow shift`` on the embedded model. Reported per server: aggregate output tokens/s
(all tokens of all clients over the wall time of the round) and whether its replies equal the
other's. Servers run from ``--a-src`` and ``--b-src`` (a checkout's ``src``: e.g. main's and a
branch's), each in its own process, started first and then taking turns round by round (the
order alternates), medians over ``--reps`` with their min-max.

    python benchmarks/concurrent_streams.py --a-src /work/main/src --b-src src
    python benchmarks/concurrent_streams.py --a-src /work/main/src --b-src src --reps 1 --max-tokens 64  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

import harness
from harness import fmt_ratio, median, ratio, spread, table
from peers import llama_cpp

TOPICS = ["the ocean", "a small town", "bread baking", "the moon landing", "chess openings", "rainforests",
          "jazz music", "the printing press", "volcanoes", "honeybees", "the Roman roads", "glaciers"]
FILLER = "Please be clear and concrete, use simple words, and mention one surprising fact. "


class Server:
    def __init__(self, name: str, src: str, port: int, args):
        self.name, self.base = name, f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(harness.embedded_model_path()),
                   "--port", str(port), "--model-name", "smollm2", "--n-ctx", str(args.n_ctx),
                   "--context-overflow", "shift"]
        env = harness.quiet_env(PYTHONPATH=str(Path(src).resolve()), OMP_NUM_THREADS=str(args.threads))
        self.log = Path(f"/tmp/concurrent_streams-{name}-{port}.log")
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start: see {self.log}")


def conversations(clients: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Tell me about {TOPICS[i % len(TOPICS)]}. " + FILLER * (1 + i % 3)}]
            for i in range(clients)]


async def one_round(server: Server, args) -> tuple[float, int, list[str]]:
    """Every client at once -> (seconds, completion tokens, replies)."""
    async with httpx.AsyncClient(timeout=3600) as client:
        async def ask(messages):
            body = {"model": "smollm2", "messages": messages, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True}
            reply = (await client.post(server.base + "/v1/chat/completions", json=body)).json()
            if "choices" not in reply:
                raise RuntimeError(f"{server.name}: {reply}")
            return reply["usage"]["completion_tokens"], reply["choices"][0]["message"]["content"]

        start = time.perf_counter()
        results = await asyncio.gather(*(ask(m) for m in conversations(args.clients)))
        return time.perf_counter() - start, sum(n for n, _ in results), [text for _, text in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-src", required=True, help="source tree of server A (e.g. main's src)")
    parser.add_argument("--b-src", required=True, help="source tree of server B (e.g. a branch's src)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--n-ctx", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=harness.cpu_count())
    args = parser.parse_args()
    print(harness.machine_line(args.threads))
    servers = [Server("A", args.a_src, llama_cpp.free_port(), args), Server("B", args.b_src, llama_cpp.free_port(), args)]
    try:
        for server in servers:
            server.wait_ready()
        for server in servers:  # warm-up: load, first forwards
            asyncio.run(one_round(server, argparse.Namespace(**{**vars(args), "max_tokens": 8, "clients": 2})))
        rates: dict[str, list[float]] = {s.name: [] for s in servers}
        replies: dict[str, list[str]] = {}
        for rep in range(args.reps):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                seconds, tokens, texts = asyncio.run(one_round(server, args))
                rates[server.name].append(tokens / seconds)
                replies[server.name] = texts
                print(f"rep {rep} {server.name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s",
                      flush=True)
    finally:
        for server in servers:
            harness.stop_process(server.process)
    same = replies["A"] == replies["B"]
    rows = [[f"{name} ({src})", spread(rates[name]), fmt_ratio(ratio(median(rates[name]), median(rates["A"])))]
            for name, src in (("A", args.a_src), ("B", args.b_src))]
    print(f"\n{args.clients} concurrent conversations, n_ctx {args.n_ctx}, {args.max_tokens} new tokens each "
          f"(prompt + max_tokens > n_ctx: shift), greedy, EOS ignored; replies equal: {same}\n")
    print(table(["server", "aggregate tok/s, median (min-max)", "vs A"], rows))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
