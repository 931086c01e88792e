"""fastdecode on a CUDA GPU against transformers, on random models of real sizes built on the GPU.

* Llama-3.2-1B size in bfloat16: batch 1, 16 and 64, 128 new tokens after 32- and 1,024-token
  prompts. fastdecode runs the engine (the decode steps replayed from CUDA graphs); transformers
  runs ``generate`` eager, and (batch 1, short prompt) with ``cache_implementation="static"``, which
  compiles its forward. Reported: the whole job's time (prompt + 128 tokens), fastdecode's decode
  tokens/s, and the HBM limit: weight bytes read per step against the measured copy bandwidth.
* bart-large size in float16: 8 sources of 512 tokens, beam 4, no-repeat-3, 64 new tokens.

Both engines generate exactly the new tokens asked (``min_new_tokens`` = ``max_new_tokens``), in
turn within each repetition; medians of ``--reps``. Needs a GPU (nothing is downloaded).

    python benchmarks/cuda_speed.py [--reps 3] [--shapes 1x32,64x1024] [--compile] [--skip-bart] [--skip-peer]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

NEW_TOKENS = 128


def gpu_timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second (the best of 10)."""
    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        seconds, _ = gpu_timed(lambda: dst.copy_(src))
        best = min(best, seconds)
    del src, dst
    return 2 * gib * 2**30 / best


def build_llama_1b():
    """Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads / 8 KV heads, FFN 8192, 128,256 words,
    tied embeddings, llama3 RoPE scaling; random bfloat16 weights on the GPU."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                            rope_theta=500000.0, tie_word_embeddings=True, bos_token_id=128000,
                            eos_token_id=128001, initializer_range=0.02,
                            rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return _on_gpu(lambda: tf.LlamaForCausalLM(config), torch.bfloat16)


def build_bart_large():
    """bart-large's shape: 12 + 12 layers, d_model 1024, 16 heads, FFN 4096, 50,265 words; float16."""
    import transformers as tf

    config = tf.BartConfig(vocab_size=50265, d_model=1024, encoder_layers=12, decoder_layers=12,
                           encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
                           decoder_ffn_dim=4096, max_position_embeddings=1024)
    return _on_gpu(lambda: tf.BartForConditionalGeneration(config), torch.float16)


def _on_gpu(make, dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            torch.manual_seed(0)
            return make().eval()
    finally:
        torch.set_default_dtype(previous)


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every parameter once (a tied embedding once, as the output layer)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def fastdecode_job(gen, prompts, new_tokens, engine):
    """Submit every prompt to a long-lived engine, step until done -> (decode seconds, tokens each)."""
    options = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    sequences = [engine.submit(p, options) for p in prompts]
    decode_start = None
    while engine.has_work():
        if decode_start is None and all(s.output_ids for s in sequences):
            torch.cuda.synchronize()
            decode_start = time.perf_counter()  # every prompt read and its first token sampled
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - decode_start, [len(s.output_ids) for s in sequences]


def hf_job(model, ids, new_tokens, **extra):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else 0,
                              **extra)


def llama_section(reps: int, shapes: list[tuple[int, int]], bandwidth: float,
                  compiled: bool) -> tuple[list[list], tuple]:
    import fastdecode

    model = build_llama_1b()
    gen = fastdecode.from_hf(model)
    limit = bandwidth / weight_bytes(model)
    print(f"Llama-1B size: {weight_bytes(model) / 1e9:.2f} GB of weights per step; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s -> batch-1 limit {limit:.0f} tok/s", flush=True)
    cache_tokens = max(b * (p + NEW_TOKENS + 32) for b, p in shapes)
    engines = {"fastdecode": gen.engine(max_batch_tokens=8192, cache_tokens=cache_tokens)}
    if compiled:  # the captured step compiled by inductor first (its element-wise ops fused)
        engines["fastdecode compiled"] = gen.engine(max_batch_tokens=8192, cache_tokens=cache_tokens,
                                                    compile_decode=True)
    rows = []
    generator = torch.Generator().manual_seed(0)
    for batch, prompt_len in shapes:
        prompts = torch.randint(10, 128000, (batch, prompt_len), generator=generator)
        ids = prompts.cuda()
        listed = prompts.tolist()
        for name, engine in engines.items():
            start = time.perf_counter()
            fastdecode_job(gen, listed, 4, engine)  # warm-up: graphs of this bucket captured (compiled)
            print(f"  {name} warm-up {time.perf_counter() - start:.1f} s", flush=True)
        hf_job(model, ids, 4)
        times, decode = {name: [] for name in engines}, {name: [] for name in engines}
        times["transformers eager"] = []
        for _ in range(reps):
            for name, engine in engines.items():
                seconds, (decode_seconds, counts) = gpu_timed(lambda: fastdecode_job(gen, listed, NEW_TOKENS, engine))
                assert counts == [NEW_TOKENS] * batch
                times[name].append(seconds)
                decode[name].append(batch * (NEW_TOKENS - 1) / decode_seconds)
            seconds, out = gpu_timed(lambda: hf_job(model, ids, NEW_TOKENS))
            assert out.shape[1] == prompt_len + NEW_TOKENS
            times["transformers eager"].append(seconds)
        eager = harness.median(times["transformers eager"])
        for name in engines:
            ours, decode_rate = harness.median(times[name]), harness.median(decode[name])
            share = f"{decode_rate / limit:.0%}" if batch == 1 else "-"
            rows.append([f"llama-1B bf16, batch {batch}, prompt {prompt_len}: {name}", f"{ours:.3f} s",
                         f"{eager:.3f} s", harness.fmt_ratio(eager / ours), f"{decode_rate:.0f}", share])
            print(rows[-1], flush=True)
    return rows, (model, gen, engines["fastdecode"])


def compiled_transformers_row(model, gen, engine, reps: int) -> list:
    """transformers with a static cache (which compiles its forward), batch 1, 32-token prompt."""
    ids = torch.randint(10, 128000, (1, 32), device="cuda")
    start = time.perf_counter()
    try:
        hf_job(model, ids, NEW_TOKENS, cache_implementation="static")  # compiles
    except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
        return ["transformers static + compile, batch 1, prompt 32", "-", f"failed: {type(exc).__name__}", "-", "-", "-"]
    compile_seconds = time.perf_counter() - start
    ours, theirs = [], []
    for _ in range(reps):
        ours.append(gpu_timed(lambda: fastdecode_job(gen, ids.tolist(), NEW_TOKENS, engine))[0])
        theirs.append(gpu_timed(lambda: hf_job(model, ids, NEW_TOKENS, cache_implementation="static"))[0])
    a, b = harness.median(ours), harness.median(theirs)
    return [f"vs transformers static + compile (compile {compile_seconds:.0f} s), batch 1, prompt 32", f"{a:.3f} s",
            f"{b:.3f} s", harness.fmt_ratio(b / a), "-", "-"]


def host_profile(job, path: str) -> None:
    """Where the host's time goes in one run of ``job`` (cProfile, the 40 costliest functions by own time):
    a GPU job whose wall time is mostly host time is bound by Python, not by the GPU."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    seconds, _ = gpu_timed(lambda: profile.runcall(job))
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)
    Path(path).write_text(f"wall {seconds:.3f} s\n{text.getvalue()}")


def replay_floor(engine) -> str:
    """The GPU time of one replay of each captured batch-1 graph (100 back to back): the step's floor."""
    lines = []
    for (rows, blocks), captured in sorted(engine.runner.compiled.graphs.items()):
        if rows != 1:
            continue
        seconds, _ = gpu_timed(lambda: [captured.graph.replay() for _ in range(100)])
        lines.append(f"graph rows 1, blocks {blocks}: {seconds * 10:.3f} ms per replay")
    return "\n".join(lines)


def kernel_profile(engine) -> str:
    """The GPU kernels of 5 eager runs of the captured batch-1 step on its own static inputs
    (torch.profiler, by GPU time): what a replay is made of."""
    from torch.profiler import ProfilerActivity, profile

    compiled = engine.runner.compiled
    captured = next(c for (rows, _), c in sorted(compiled.graphs.items()) if rows == 1)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            compiled.step(captured.table, captured.tokens, captured.positions, captured.windowed)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=40)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=40)


def bart_section(reps: int, profile: str | None = None) -> list[list]:
    import fastdecode

    model = build_bart_large()
    gen = fastdecode.from_hf(model)
    generator = torch.Generator().manual_seed(1)
    sources = torch.randint(10, 50000, (8, 512), generator=generator)
    ids, listed = sources.cuda(), sources.tolist()
    options = dict(num_beams=4, no_repeat_ngram_size=3, max_new_tokens=64, min_new_tokens=64)
    gen.generate_ids(listed[:1], **dict(options, max_new_tokens=4, min_new_tokens=4))  # warm-up
    hf_job(model, ids[:1], 4, num_beams=4)
    ours, theirs = [], []
    same = None
    for _ in range(reps):
        seconds, mine = gpu_timed(lambda: gen.generate_ids(listed, **options))
        ours.append(seconds)
        seconds, out = gpu_timed(lambda: hf_job(model, ids, 64, num_beams=4, no_repeat_ngram_size=3))
        theirs.append(seconds)
        same = sum(a == b.tolist()[1:] for a, b in zip(mine, out))  # (transformers': decoder start first)
    if profile:
        host_profile(lambda: gen.generate_ids(listed, **options), profile)
    a, b = harness.median(ours), harness.median(theirs)
    return [[f"bart-large fp16, 8 x 512, beam 4, no-repeat 3, 64 tokens ({same}/8 outputs identical)",
             f"{a:.3f} s", f"{b:.3f} s", harness.fmt_ratio(b / a), "-", "-"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--shapes", default="1x32,16x32,64x32,1x1024,16x1024,64x1024",
                        help="Llama jobs as BATCHxPROMPT, comma-separated")
    parser.add_argument("--compile", action="store_true", help="also the engine with the compiled captured step")
    parser.add_argument("--skip-bart", action="store_true")
    parser.add_argument("--profile-bart", metavar="FILE", help="write a host profile of one BART job to FILE")
    parser.add_argument("--profile-llama", metavar="FILE", help="write a host profile of one batch-1 job to FILE")
    parser.add_argument("--skip-peer", action="store_true", help="no transformers static cache + compile row")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_speed.py needs a CUDA GPU")
    import transformers

    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}",
          flush=True)
    bandwidth = copy_bandwidth()
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",") if shape]
    rows, model = [], None
    if shapes:  # (--shapes "": the BART job alone)
        rows, (model, gen, engine) = llama_section(args.reps, shapes, bandwidth, args.compile)
    if not args.skip_bart:
        rows += bart_section(args.reps, args.profile_bart)
        print(rows[-1], flush=True)
    if args.profile_llama and model is not None:  # batch 1, short prompt: host time per step against the replay
        ids = torch.randint(10, 128000, (1, 32)).tolist()
        host_profile(lambda: fastdecode_job(gen, ids, NEW_TOKENS, engine), args.profile_llama)
        with open(args.profile_llama, "a") as file:
            file.write(replay_floor(engine) + "\n")
            file.write(kernel_profile(engine) + "\n")
    if not args.skip_peer and model is not None:  # last: its compilation takes a while
        rows.append(compiled_transformers_row(model, gen, engine, args.reps))
    print(harness.table(["job", "fastdecode", "transformers eager", "speed-up", "decode tok/s", "of HBM limit"],
                        rows))


if __name__ == "__main__":
    main()
