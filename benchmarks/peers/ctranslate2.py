"""The embedded GGUF as a float32 Hugging Face folder (for transformers serve and CTranslate2) and as a
CTranslate2 model, converted once and cached on disk. The conversion runs in a subprocess (this file run
as a script), so that the benchmark's parent process never imports torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import quiet_env  # noqa: E402


def hf_folder_from_gguf(gguf: Path, folder: Path) -> Path:
    """The GGUF dequantized to a float32 Hugging Face folder, once (imports torch and transformers)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.config.architectures = [type(model).__name__]  # `transformers serve` needs it; the GGUF has none
    model.hf_quantizer = None  # the weights are dequantized float32 tensors already: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prepare_ctranslate2(gguf: Path, cache_root: Path) -> dict[str, str] | None:
    """{hf_dir, ct2_dir, vocab} of a float32 CTranslate2 conversion of ``gguf`` (converted once, in a
    subprocess), or None when ctranslate2 is not installed or the conversion failed (said on stderr).
    ``vocab``: a JSON list id -> token string, what CTranslate2 takes as input."""
    if importlib.util.find_spec("ctranslate2") is None:
        return None
    import ctranslate2

    root = cache_root / f"{gguf.stem}-{gguf.stat().st_size}-ct2-{ctranslate2.__version__}"
    hf_dir, ct2_dir = root / "hf", root / "ct2"
    if not (ct2_dir / "model.bin").is_file() or not (ct2_dir / "id_to_token.json").is_file():
        print(f"converting the model for CTranslate2 into {root} (once; ~40 s) ...", file=sys.stderr)
        # -P: not this file's folder first on sys.path, where this file would shadow the ctranslate2 package
        command = [sys.executable, "-P", str(Path(__file__).resolve()), str(gguf), str(hf_dir), str(ct2_dir)]
        done = subprocess.run(command, env=quiet_env(), capture_output=True, text=True)
        if done.returncode != 0:
            print(f"CTranslate2 conversion failed; skipping it:\n{done.stderr[-2000:]}", file=sys.stderr)
            return None
    return {"hf_dir": str(hf_dir), "ct2_dir": str(ct2_dir), "vocab": str(ct2_dir / "id_to_token.json")}


def _convert(gguf: Path, hf_dir: Path, ct2_dir: Path) -> None:
    import ctranslate2
    from tokenizers import Tokenizer

    hf_folder_from_gguf(gguf, hf_dir)
    ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), quantization="float32",
                                                                      force=True)
    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    vocab = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    (ct2_dir / "id_to_token.json").write_text(json.dumps(vocab))


if __name__ == "__main__":
    _convert(*(Path(arg) for arg in sys.argv[1:4]))
