#!/usr/bin/env python
"""Quantized execution benchmark: the embedded Q4_1 GGUF run natively, against the field.

Engines (each in its own worker process, started one at a time; after one untimed warm-up repetition
(not with --quick), engines alternate within every repetition; medians):
fastdecode native (the GGUF's own blocks, load's default prompt rows "int8-mlp"; -int8 / -exact: with
prompt_rows "int8" / "exact"), fastdecode float32 (blocks dequantized at load),
llama.cpp on the same file (its own llama-server with 8 parallel slots; see peers/llama_cpp.py),
CTranslate2 float32 and int8 (a conversion of the same weights), transformers (the GGUF dequantized).
Rows: load time, first token after process start, tokens/s at batch 1 (64 new tokens) and batch 8
(128), prompt processing on a 512-token prompt, resident memory, and the bandwidth limit for the
bytes each engine reads per token.
Then a bart-base-size random model, 8 sources x 256 tokens, beam 4: fastdecode int8 / float32 vs
CTranslate2 int8 / float32.

    python benchmarks/quantized_speed.py [--reps 3] [--threads 2] [--quick] [--skip-bart] [--engines a,b]
    python benchmarks/quantized_speed.py --skip-embedded --threads 1 [--bart-engines fastdecode-int8,ct2-int8]
    python benchmarks/quantized_speed.py --llama-cpp-bin ~/llama.cpp/build/bin

An engine that cannot run here is listed as NOT RUN with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from decode_engines import PROMPT_IDS, batch_prompts, long_prompt
from harness import Worker, limit_tokens_per_s, median, not_run, spread, table
from peers import llama_cpp
from peers.ctranslate2 import prepare_ctranslate2

ENGINES = ("fastdecode-native", "fastdecode-native-int8", "fastdecode-native-exact", "fastdecode-float32", "llama.cpp", "ct2-float32", "ct2-int8", "transformers")
CACHE = Path(tempfile.gettempdir()) / "fastdecode-bench"


# --- engines (inside worker processes) -----------------------------------------------------------
class Engine:
    """generate(prompts, new_tokens, num_beams) -> rows of new ids; ready_info(): the first token after
    process start and the bytes read per token (for the bandwidth limit)."""

    bytes_per_token: int | None = None

    def __init__(self, options: dict[str, Any]):
        self.options = options

    def ready_info(self) -> dict[str, Any]:
        self.generate([self.options["first_prompt"]], 1)
        return {"first_token_s": time.time() - self.options["launched_at"], "bytes_per_token": self.bytes_per_token}


class Fastdecode(Engine):
    def __init__(self, options: dict[str, Any]):
        import fastdecode

        super().__init__(options)
        if options.get("avx2_only"):  # the AVX2 kernels where the CPU has AVX-512 too (the same results)
            try:
                from fastdecode.layers.ops import set_avx512
            except ImportError:  # an older tree
                from fastdecode.layers.kernels import set_avx512
            set_avx512(False)
        self.gen = fastdecode.load(options.get("source"), quantize=options.get("quantize"),
                                   **({"prompt_rows": options["prompt_rows"]} if "prompt_rows" in options else {}))
        self.bytes_per_token = self.gen.inspect()["weight_bytes_read_per_token"]

    def generate(self, prompts, new_tokens, num_beams=1):
        extra = {"num_beams": num_beams, "min_new_tokens": new_tokens} if num_beams > 1 else {"eos_token_id": []}
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, **extra)


class CTranslate2(Engine):
    def __init__(self, options: dict[str, Any]):
        import ctranslate2

        super().__init__(options)
        cls = ctranslate2.Translator if options.get("seq2seq") else ctranslate2.Generator
        self.model = cls(options["ct2_dir"], device="cpu", compute_type=options["compute_type"], inter_threads=1,
                         intra_threads=options["threads"])
        self.seq2seq = bool(options.get("seq2seq"))
        self.vocab = json.loads(Path(options["vocab"]).read_text())

    def generate(self, prompts, new_tokens, num_beams=1):
        tokens = [[self.vocab[i] for i in p] for p in prompts]
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

        super().__init__(options)
        path = harness.embedded_model_path()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
        unique = {p.data_ptr(): p for p in self.model.parameters()}.values()
        self.bytes_per_token = sum(p.numel() * p.element_size() for p in unique)

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
    return CTranslate2(options) if name.startswith("ct2") else Transformers(options)


# --- sections (parent side) ----------------------------------------------------------------------
def missing_module(name: str) -> str | None:
    """None when the engine's Python package is installed, else why not."""
    module = {"ct2-float32": "ctranslate2", "ct2-int8": "ctranslate2", "transformers": "transformers"}.get(name)
    return None if module is None or importlib.util.find_spec(module) else f"{module} not installed"


def llama_cpp_peer(args) -> tuple[llama_cpp.ServerPeer | None, str | None]:
    """llama-server with 8 parallel slots on the same file, started (and timed) now, or why it cannot run."""
    binary, why = llama_cpp.find_binary("llama-server", llama_cpp.bin_dir(args.llama_cpp_bin))
    if binary is None:
        return None, why
    gguf = harness.embedded_model_path()
    try:
        peer = llama_cpp.ServerPeer(binary, gguf, args.threads, PROMPT_IDS[:8], parallel=8)
    except (RuntimeError, OSError) as exc:
        return None, str(exc)
    peer.ready["bytes_per_token"] = gguf.stat().st_size
    return peer, None


def embedded_section(args) -> str:
    options = {"threads": args.threads, "first_prompt": PROMPT_IDS[:8]}
    wanted = [n for n in (args.engines.split(",") if args.engines else ENGINES)]
    ct2 = prepare_ctranslate2(harness.embedded_model_path(), CACHE) if any(n.startswith("ct2") for n in wanted) \
        and missing_module("ct2-int8") is None else None
    per_engine = {"fastdecode-native": {}, "fastdecode-native-int8": {"prompt_rows": "int8"},
                  "fastdecode-native-exact": {"prompt_rows": "exact"},
                  "fastdecode-float32": {"quantize": "dequantize"},
                  "ct2-float32": {**(ct2 or {}), "compute_type": "float32"},
                  "ct2-int8": {**(ct2 or {}), "compute_type": "int8"}, "transformers": {}}
    missing = {n: missing_module(n) or ("conversion failed" if n.startswith("ct2") and not ct2 else None)
               for n in wanted if n != "llama.cpp"}
    start = {n: {**options, **per_engine[n]} for n, why in missing.items() if why is None}
    # one at a time: the load and first-token columns are each engine's own, not six loads sharing two cores
    workers, failed = harness.start_workers(Path(__file__).resolve(), start, Path(tempfile.mkdtemp(prefix="qbench-")),
                                            one_at_a_time=True)
    missing = {**{n: why for n, why in missing.items() if why}, **failed}
    peers: dict[str, Any] = dict(workers)
    if "llama.cpp" in wanted:
        peer, why = llama_cpp_peer(args)
        if peer is None:
            missing["llama.cpp"] = why
        else:
            peers = {**{n: w for n, w in workers.items() if n.startswith("fastdecode")}, "llama.cpp": peer,
                     **{n: w for n, w in workers.items() if not n.startswith("fastdecode")}}
    new1, new8 = (16, 16) if args.quick else (64, 128)
    prompt_length = 512
    jobs = {"batch 1": {"prompts": batch_prompts(1), "new_tokens": new1},
            "batch 8": {"prompts": batch_prompts(8), "new_tokens": new8},
            "prompt": {"prompts": [long_prompt(prompt_length)], "new_tokens": 1}}
    runs = harness.alternate_workers(peers, jobs, args.reps, warmup=not args.quick)
    bandwidth = max(harness.measure_bandwidth(args.threads, 3).values())  # the best of a sum and two GEMV layouts
    rows, rates = [], {}
    for name, peer in peers.items():
        ready, seconds = peer.ready, {job: [r["seconds"] for r in replies] for job, replies in runs[name].items()}
        rates[name] = [median(new1 / s for s in seconds["batch 1"]), median(8 * new8 / s for s in seconds["batch 8"]),
                       median(prompt_length / s for s in seconds["prompt"])]
        rss = peer.call("memory")["now"]["rss"] if isinstance(peer, Worker) else ready["rss_kib"]
        per_token = ready.get("bytes_per_token")
        limit = limit_tokens_per_s(bandwidth, per_token)
        rows.append([name, f"{ready['load_s']:.2f}" if "load_s" in ready else "-",
                     f"{ready['first_token_s']:.2f}" if "first_token_s" in ready else "-",
                     spread([new1 / s for s in seconds["batch 1"]]), spread([8 * new8 / s for s in seconds["batch 8"]]),
                     spread([prompt_length / s for s in seconds["prompt"]], 0), f"{rss / 1024:.0f}" if rss else "-",
                     f"{per_token / 1e6:.0f}" if per_token else "-", f"{limit:.0f}" if limit else "-"])
    harness.close_all(peers)
    header = ["engine", "load s", "first token s", "batch 1 tok/s", "batch 8 tok/s", f"prompt {prompt_length} tok/s",
              "RSS MB", "MB read/token", "bandwidth limit tok/s"]
    lines = [f"## Embedded SmolLM2-135M Q4_1 GGUF, {args.threads} threads, {args.reps} reps: median (min-max); "
             f"memory bandwidth {bandwidth:.1f} GB/s", "", harness.machine_line(args.threads), "",
             table(header, rows + [not_run(n, why, len(header)) for n, why in missing.items()]), ""]
    if "llama.cpp" in peers:
        lines.append("- llama.cpp: llama-server with 8 parallel slots (continuous batching) on the same file; each "
                     "call sends its prompts as concurrent /completion requests (greedy, ignore_eos, exactly the new "
                     "tokens) and is timed to the last answer; load and first token: process start to a ready "
                     "/health and to a 1-token completion")
    native_engine_s = peers["fastdecode-native"].ready.get("engine_s") if "fastdecode-native" in peers else None
    return "\n".join(lines + targets(rates, {r[0]: r for r in rows}, native_engine_s))


def targets(rate: dict[str, list[float]], rows: dict[str, list[str]], native_engine_s: float | None) -> list[str]:
    def ratio(a: str, b: str, index: int) -> str:
        if a not in rate or b not in rate:
            return "n/a (not run)"
        return f"{rate[a][index] / rate[b][index]:.2f}x"

    native = rows.get("fastdecode-native")
    return [
        f"- batch 1, native vs llama.cpp: {ratio('fastdecode-native', 'llama.cpp', 0)} (target >= 1.1x)",
        f"- batch 8, native vs CTranslate2 int8: {ratio('fastdecode-native', 'ct2-int8', 1)} (target >= 1.5x)",
        f"- batch 8, native vs llama.cpp: {ratio('fastdecode-native', 'llama.cpp', 1)}",
        f"- prompt processing, native vs llama.cpp: {ratio('fastdecode-native', 'llama.cpp', 2)} (target >= 1x)",
        f"- prompt processing, native (int8-mlp prompt rows) vs CTranslate2 int8: "
        f"{ratio('fastdecode-native', 'ct2-int8', 2)} (issue 29: >= 1.0x), vs llama.cpp: "
        f"{ratio('fastdecode-native', 'llama.cpp', 2)} (issue 29: >= 2x); with int8 prompt rows: "
        f"{ratio('fastdecode-native-int8', 'ct2-int8', 2)} and {ratio('fastdecode-native-int8', 'llama.cpp', 2)}",
        f"- load {native[1] if native else '?'} s after process start (target <= 1 s; fastdecode.load() itself "
        f"{f'{native_engine_s:.2f}' if native_engine_s is not None else '?'} s, the rest Python and import torch), "
        f"first token {native[2] if native else '?'} s after process start (target <= 1.5 s)",
        f"- float32 batch 1 vs CTranslate2 float32: {ratio('fastdecode-float32', 'ct2-float32', 0)} (target >= 1x)",
    ]


def ct2_bart_converter(ctranslate2, folder: Path):
    """CTranslate2's converter for the random BART folder. Two gaps closed: the folder gets a word-level
    tokenizer with one token per id (CTranslate2 takes its vocabulary from the tokenizer, and the
    benchmark speaks ids: "<s>", "<pad>", "</s>", "<unk>", then "t4", "t5", ...), and the loaded config
    gets ``normalize_before = False`` (BART is post-norm; transformers 5 dropped the attribute that
    CTranslate2 4.x still reads)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    if not (folder / "tokenizer.json").exists():
        size = AutoConfig.from_pretrained(folder).vocab_size
        specials = ["<s>", "<pad>", "</s>", "<unk>"]
        vocab = {token: i for i, token in enumerate(specials + [f"t{i}" for i in range(len(specials), size)])}
        word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        PreTrainedTokenizerFast(tokenizer_object=word_level, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(folder)

    class PostNormBart(ctranslate2.converters.TransformersConverter):
        def load_model(self, model_class, model_name_or_path, **kwargs):
            model = super().load_model(model_class, model_name_or_path, **kwargs)
            model.config.normalize_before = False
            return model

    return PostNormBart(str(folder))


def bart_section(args) -> str:
    """bart-base size (random weights), 8 sources x 256 tokens, beam 4."""
    from random_models import build_bart

    folder = CACHE / "bart-base-random"
    if not (folder / "config.json").exists():
        build_bart().save_pretrained(folder)
    options = {"threads": args.threads, "first_prompt": list(range(3, 11)), "source": str(folder)}
    per_engine = {"fastdecode-int8": {"quantize": "int8"},
                  "fastdecode-int8-avx2": {"quantize": "int8", "avx2_only": True}, "fastdecode-float32": {}}
    ct2_dir = folder.parent / "bart-base-random-ct2"
    skipped = {}
    from fastdecode.layers.kernels import cpu_has_avx512  # (no torch import)

    if not cpu_has_avx512():
        del per_engine["fastdecode-int8-avx2"]  # (the same row as fastdecode-int8 there)
    if missing_module("ct2-int8"):
        skipped["ct2-int8"] = skipped["ct2-float32"] = missing_module("ct2-int8")
    elif not (ct2_dir / "model.bin").exists():
        import ctranslate2

        try:
            ct2_bart_converter(ctranslate2, folder).convert(str(ct2_dir), force=True)
        except Exception as exc:  # noqa: BLE001 - e.g. a converter older than this transformers
            skipped["ct2-int8"] = skipped["ct2-float32"] = f"its converter failed ({type(exc).__name__}: {exc})"
    if (ct2_dir / "model.bin").exists():
        vocab = ct2_dir / "id_to_token.json"
        if not vocab.exists():
            vocab.write_text((ct2_dir / "shared_vocabulary.json").read_text())
        for compute in ("int8", "float32"):
            per_engine[f"ct2-{compute}"] = {"ct2_dir": str(ct2_dir), "compute_type": compute, "seq2seq": True,
                                            "vocab": str(vocab)}
    if args.bart_engines:
        chosen = args.bart_engines.split(",")
        per_engine = {name: extra for name, extra in per_engine.items() if name in chosen}
        skipped = {name: why for name, why in skipped.items() if name in chosen}
    wanted = {name: {**options, **extra} for name, extra in per_engine.items()}
    workers, failed = harness.start_workers(Path(__file__).resolve(), wanted, Path(tempfile.mkdtemp(prefix="qbart-")))
    sources = [[(7 * i + 13 * j) % 50000 + 4 for j in range(256)] for i in range(8)]
    new_tokens = 16 if args.quick else 64
    runs = harness.alternate_workers(workers, {"beam 4": {"prompts": sources, "new_tokens": new_tokens,
                                                         "num_beams": 4}}, args.reps, warmup=not args.quick)
    harness.close_all(workers)
    seconds = {name: [r["seconds"] for r in by_job["beam 4"]] for name, by_job in runs.items()}
    base = median(seconds["ct2-int8"]) if "ct2-int8" in seconds else None
    rows = [[name, spread(s, 2), spread([8 * new_tokens / x for x in s]),
             harness.fmt_ratio(harness.ratio(base, median(s)))] for name, s in seconds.items()]
    header = ["engine", "seconds", "tokens/s", "vs CTranslate2 int8"]
    rows += [not_run(n, why, len(header)) for n, why in {**skipped, **failed}.items()]
    return "\n".join([f"## bart-base size (random weights), 8 x 256 source tokens, beam 4, {new_tokens} new tokens",
                      "", table(header, rows), "", "- target: fastdecode int8 >= CTranslate2 int8"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="16 new tokens (batch 1 and 8), 16 for bart")
    parser.add_argument("--skip-bart", action="store_true")
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--engines", help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--bart-engines", help="comma-separated subset of the BART row's fastdecode-int8, "
                        "fastdecode-int8-avx2 (its AVX2 kernels, on a CPU with AVX-512), fastdecode-float32, "
                        "ct2-int8, ct2-float32 (with --skip-embedded: only the BART row)")
    parser.add_argument("--llama-cpp-bin", default=None,
                        help=f"folder of the llama.cpp binaries (default: $LLAMA_CPP_BIN or {llama_cpp.DEFAULT_BIN})")
    harness.add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return harness.serve_worker(lambda options: make_engine(args.worker, options), json.loads(args.options))
    print("Timings are wall-clock medians of alternating runs; on a shared machine compare the ratios.\n")
    if not args.skip_embedded:
        print(embedded_section(args), "\n", flush=True)
    if not args.skip_bart:
        print(bart_section(args), flush=True)


if __name__ == "__main__":
    main()
