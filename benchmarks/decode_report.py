"""The markdown report of decode_speed.py: one render function per section, and the targets."""

from __future__ import annotations

from typing import Any

from harness import BANDWIDTH_LABELS, fmt_ratio, limit_tokens_per_s, ratio, spread, table

ENGINE_ORDER = ("fastdecode", "transformers", "ctranslate2")

# The targets from the performance issue, and with --model gemma3 issue 14's.
TARGET_SPEEDUP_B1 = 2.0
TARGET_SPEEDUP_B8 = 1.5
TARGET_BANDWIDTH_FRACTION = 0.75
TARGET_COLD_START_S = 5.0
GEMMA_TARGET_LOAD_S = 5.0
GEMMA_TARGET_SPEEDUP_B1 = 3.0


def fmt_rate(entry: dict[str, Any] | None) -> str:
    return spread(entry["runs_tokens_per_s"]) if entry else "-"


def rate_of(results: dict[str, Any], engine: str, batch: int) -> float | None:
    entry = results["throughput"].get(engine, {}).get(batch)
    return entry["median_tokens_per_s"] if entry else None


def describe_check(check: dict[str, Any]) -> str:
    if check["identical"]:
        text = "identical"
    else:
        diff = check["first_difference"]
        text = (f"DIFFERENT ({check['rows_equal']}/{check['rows']} rows equal; first difference: row {diff['row']}, "
                f"new token {diff['new_token']})")
    if check["cut_at_eos"]:
        rows = ", ".join(f"row {r} at new token {i}" for r, i in check["cut_at_eos"].items())
        text += (f" (compared up to fastdecode's first EOS: {rows}; the other engine's min_new_tokens "
                 "suppresses EOS there)")
    return text


def render_throughput(results: dict[str, Any], settings: Any) -> str:
    engines = [e for e in ENGINE_ORDER if e in results["throughput"]]
    header = ["batch"] + [f"{e} tok/s" for e in engines] + [f"fastdecode / {e}" for e in engines[1:]]
    rows = []
    for batch in settings.batch_sizes:
        row = [str(batch)] + [fmt_rate(results["throughput"][e].get(batch)) for e in engines]
        fd_rate = rate_of(results, "fastdecode", batch)
        row += [fmt_ratio(ratio(fd_rate, rate_of(results, e, batch))) for e in engines[1:]]
        rows.append(row)
    lines = [f"### 1. Throughput ({settings.new_tokens} new tokens after a {len(results['prompt_ids'])}-token prompt, greedy, "
             f"{settings.threads} threads; median of {settings.reps} alternating reps, (min-max))", "",
             table(header, rows), "",
             "tokens/s = batch x new tokens / wall time of the whole call (prefill of the short prompt included)."]
    loads = ", ".join(f"{e} b{b} {results['throughput'][e][b]['median_other_load']:.2f}"
                      for e in engines for b in settings.batch_sizes)
    lines.append(f"Contention: cores (of {results['machine']['cpus']}) kept busy by other processes during the timed "
                 f"calls, median over reps (/proc/stat busy time minus the engine's own CPU time): {loads}.")
    for name, check in results.get("token_checks", {}).items():
        lines.append(f"- greedy tokens, {name}: {describe_check(check)}")
    for name, by_batch in results["throughput"].items():
        for batch, entry in by_batch.items():
            if not entry["all_lengths_ok"]:
                lines.append(f"- WARNING: {name} batch {batch} did not produce exactly "
                             f"{settings.new_tokens} tokens per row")
            if not entry["deterministic"]:
                lines.append(f"- note: {name} batch {batch} produced different tokens across repetitions")
    return "\n".join(lines)


def render_memory(results: dict[str, Any]) -> str:
    rows = []
    for name in ENGINE_ORDER:
        mem = results["memory"].get(name)
        if not mem or not mem.get("loaded"):
            continue
        loaded, now = mem["loaded"], mem["now"]
        decode_peak = now["hwm"] if mem["peak_reset"] else None
        process_peak = max(loaded["ru_maxrss"], loaded["hwm"], now["hwm"])
        mib = lambda kib: f"{kib / 1024:.0f}" if kib is not None else "-"  # noqa: E731
        rows.append([name, mib(loaded["rss"]), mib(decode_peak),
                     mib(decode_peak - loaded["rss"]) if decode_peak is not None else "-", mib(process_peak)])
    return "\n".join([
        "### 2. Memory (MiB, each engine in its own process)", "",
        table(["engine", "RSS loaded", "peak RSS while decoding", "decode increase", "process peak (incl. load)"],
              rows), "",
        "RSS loaded: VmRSS after load + a warm-up generation. Peak while decoding: VmHWM over the throughput "
        "runs (reset after warm-up via /proc/self/clear_refs), so decode increase = peak - loaded. "
        "Process peak: the highest of VmHWM / ru_maxrss before the reset and VmHWM after it, i.e. what "
        "ru_maxrss at exit would report without the reset (imports and load-time conversion included)."])


def render_bandwidth(results: dict[str, Any]) -> str:
    bw, model = results["bandwidth"], results["model"]
    per_step = model["bytes_per_step"]
    b1 = {e: rate_of(results, e, 1) for e in ENGINE_ORDER}
    header = ["read benchmark", "GB/s", "limit tok/s (batch 1)"] + [f"{e} % of limit" for e in ENGINE_ORDER if b1[e]]
    rows = []
    for key, label in BANDWIDTH_LABELS.items():
        limit = limit_tokens_per_s(bw[key], per_step)
        rows.append([label, f"{bw[key]:.1f}", f"{limit:.1f}"] +
                    [f"{100 * b1[e] / limit:.0f}%" for e in ENGINE_ORDER if b1[e]])
    lines = ["### 3. Bandwidth limit (batch 1)", "",
             f"Weight bytes read per decode step: {per_step / 1e6:.1f} MB (fastdecode's weights as loaded, "
             f"{'/'.join(model.get('weight_types', []))}, each quantized tensor at its real size, tied embedding "
             f"counted once, as the LM head). fastdecode keeps {model['resident_weight_bytes'] / 1e6:.1f} MB of weights "
             "resident" + (" (the LM head is a separate transposed copy of the tied embedding)"
                           if model.get("lm_head_is_copy") else "") + ".",
             "", table(header, rows), "",
             "limit tok/s = bandwidth / bytes per step (one full read of the weights per token)."]
    if model.get("transformers_bytes_per_step") and model["transformers_bytes_per_step"] != per_step:
        total = model["transformers_bytes_per_step"] / 1e6
        lines.append(f"- note: transformers' parameters (tied once) total {total:.1f} MB")
    return "\n".join(lines)


def render_context(results: dict[str, Any], settings: Any) -> str:
    ctx = results["context"]
    short, long = settings.short_context, settings.long_context
    rows = []
    for path in ("cached", "naive"):
        a, b = ctx[path][short]["median_step_s"], ctx[path][long]["median_step_s"]
        rows.append([path, f"{a * 1000:.1f}", f"{b * 1000:.1f}", f"{b / a:.2f}x",
                     f"{len(ctx[path][short]['steps'])} / {len(ctx[path][long]['steps'])}"])
    return "\n".join([
        "### 4. fastdecode per-step decode time (ms, batch 1, median over steps)", "",
        table(["path", f"context {short}", f"context {long}", f"{long} / {short}", "steps timed"], rows), "",
        "Each step is the gap between consecutive streamed tokens after a prompt of (context - steps) tokens, "
        "so prefill is excluded and the last step sees the full context. naive = use_cache=False "
        "(the whole sequence is re-run every step)."])


def render_cold_start(results: dict[str, Any], settings: Any) -> str:
    rows = []
    for name, label in (("fastdecode", "`fastdecode generate --max-new-tokens 1`"),
                        ("transformers", "transformers: load GGUF + tokenize + generate 1")):
        entry = results["cold_start"].get(name)
        if entry:
            exits = [f"{r['exit_s']:.2f}" for r in entry["runs"]]
            rows.append([label, f"{entry['median_s']:.2f}", str(len(entry["runs"])), ", ".join(exits)])
    return "\n".join([
        f"### 6. Cold start (seconds from process start to the first token on stdout; prompt "
        f"\"{results['cold_start_prompt']}\")", "",
        table(["command", "first token (median)", "runs", "process exit (each run)"], rows)])


def evaluate_targets(results: dict[str, Any]) -> list[list[str]]:
    """[target, measured, PASS/FAIL/n.a.] rows."""

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    rows = []
    if results["model_name"] == "gemma3":
        load = results["load_s"]["fastdecode"]
        theirs = results["load_s"].get("transformers")
        measured = f"{load:.2f} s" + (f" (transformers {theirs:.1f} s)" if theirs else "")
        rows.append([f"Gemma 3 load (worker: import + load) <= {GEMMA_TARGET_LOAD_S:.0f} s", measured,
                     verdict(load <= GEMMA_TARGET_LOAD_S)])
        value = ratio(rate_of(results, "fastdecode", 1), rate_of(results, "transformers", 1))
        rows.append([f"Gemma 3 batch 1 >= {GEMMA_TARGET_SPEEDUP_B1:.0f}x transformers tokens/s", fmt_ratio(value),
                     verdict(None if value is None else value >= GEMMA_TARGET_SPEEDUP_B1)])
    for batch, target in ((1, TARGET_SPEEDUP_B1), (8, TARGET_SPEEDUP_B8)):
        value = ratio(rate_of(results, "fastdecode", batch), rate_of(results, "transformers", batch))
        rows.append([f">= {target:.1f}x transformers tokens/s at batch {batch}", fmt_ratio(value),
                     verdict(None if value is None else value >= target)])
    b1, per_step = rate_of(results, "fastdecode", 1), results["model"]["bytes_per_step"]
    for key, label in (("sum", "torch.sum"), ("gemv_x_at_w", "GEMV x @ W")):
        fraction = b1 / (results["bandwidth"][key] * 1e9 / per_step)
        rows.append([f"batch-1 tokens/s >= {TARGET_BANDWIDTH_FRACTION:.0%} of the bandwidth limit ({label})",
                     f"{fraction:.0%}", verdict(fraction >= TARGET_BANDWIDTH_FRACTION)])
    cold = results["cold_start"].get("fastdecode", {}).get("median_s")
    has_cold = cold is not None and cold == cold  # not NaN
    rows.append([f"cold start to first token <= {TARGET_COLD_START_S:.0f} s", f"{cold:.2f} s" if has_cold else "-",
                 verdict(cold <= TARGET_COLD_START_S if has_cold else None)])
    check = results.get("token_checks", {}).get("fastdecode vs transformers, batch 1")
    if check is not None:
        rows.append(["greedy tokens identical to transformers at batch 1",
                     "yes" if check["identical"] else f"no (first differs at new token "
                                                      f"{check['first_difference']['new_token']})",
                     verdict(check["identical"])])
    return rows


def best_rep_note(results: dict[str, Any], settings: Any) -> str:
    """The speedups from each engine's fastest repetition: the least disturbed by other processes."""
    if "transformers" not in results["throughput"]:
        return ""
    best = {e: {b: max(results["throughput"][e][b]["runs_tokens_per_s"]) for b in settings.batch_sizes}
            for e in ("fastdecode", "transformers")}
    pieces = [f"batch {b}: {best['fastdecode'][b]:.1f} vs {best['transformers'][b]:.1f} tok/s = "
              f"{best['fastdecode'][b] / best['transformers'][b]:.2f}x" for b in settings.batch_sizes]
    return ("Results are judged on medians. For reference, fastest repetition of each engine "
            "(fastdecode vs transformers): " + "; ".join(pieces) + ".")


def render(results: dict[str, Any], settings: Any) -> str:
    machine = results["machine"]
    head = (f"## fastdecode decode-speed benchmark{' (--quick: indicative only)' if results['quick'] else ''}\n\n"
            f"{machine['line']} at start, {machine['load_average_end'][0]:.2f} at end, torch {machine['torch']}; "
            f"other processes "
            f"kept {machine['other_load_avg']:.2f} of {machine['cpus']} cores busy on average during the run; "
            f"total {results['elapsed_s']:.0f} s.")
    if machine["other_load_avg"] > 0.25:
        head += (f"\n\n**Warning: the machine was shared: other processes kept {machine['other_load_avg']:.2f} cores "
                 "busy on average, so the timings below understate what every engine does on an idle machine, "
                 "and multi-threaded engines suffer most.**")
    parts = [head, render_throughput(results, settings), render_memory(results), render_bandwidth(results),
             render_context(results, settings)]
    if "ctranslate2" not in results["throughput"]:
        parts.append("### 5. CTranslate2\n\nskipped: ctranslate2 is not importable (pip install ctranslate2).")
    else:
        parts.append("### 5. CTranslate2\n\nIncluded as a column above (float32 conversion of the same weights, "
                     f"inter_threads=1, intra_threads={settings.threads}, generate_batch with sampling_topk=1).")
    parts.append(render_cold_start(results, settings))
    results["targets"] = evaluate_targets(results)
    parts.append("### Targets\n\n" + table(["target", "measured", "result"], results["targets"]) + "\n\n"
                 + best_rep_note(results, settings))
    return "\n\n".join(parts) + "\n"
