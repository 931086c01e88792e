"""The memory a request implies, checked against a limit before anything is allocated.

A request's big buffers are known from its options before it runs: the KV cache (rows x slots x
bytes per token), the encoder-decoder cross-attention cache, the logits and sampling buffers
(rows x vocabulary), the prefill activations. ``check_request_memory`` adds them up and raises
``MemoryLimitError`` naming the option that makes the request large, instead of letting the
allocator (or the kernel's OOM killer) fail half way. The limit is ``max_memory`` when given,
else the memory available now (``MemAvailable`` in /proc/meminfo; free memory on a CUDA device).
The estimate is deliberately a little generous (transient buffers counted), never a promise.

The KV cache is layered (engine/slots.py): full-attention layers hold every token of a sequence,
sliding-window layers only their window plus one prompt chunk, so for a model with sliding layers
the estimate grows with the context only by the full layers' bytes per token.
"""

from __future__ import annotations

import os
import re
from typing import Any

from .errors import InvalidOptionError, MemoryLimitError

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
PREFILL_CHUNK = 512  # the longest chunk a streaming cache prefills at once (its headroom)
ENGINE_CHUNK = 256  # the engine's default prefill_chunk: the longest chunk of a model with sliding layers
BLOCK_SLACK = 2 * 16  # a sliding kind's blocks may start and end part-way (two blocks of 16 slots)


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as "8GB", "512MiB", "2g" -> int >= 1."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 1:
            return value
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _UNITS:
            size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if size >= 1:
                return size
    raise InvalidOptionError(f"max_memory must be a number of bytes >= 1 or a size such as '8GB' or '512MiB', "
                             f"got {value!r}")


def format_size(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if size < 1000 or unit == "PB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def available_memory(device: Any = "cpu") -> int | None:
    """Bytes that can be allocated now on ``device``; None when unknown."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def sequence_kv_bytes(model_config: Any, num_tokens: int, element_bytes: int, chunk: int = ENGINE_CHUNK) -> int:
    """K/V bytes one sequence of ``num_tokens`` holds at its peak in the engine's layered cache:
    full layers every token, sliding layers at most their window plus one chunk."""
    by_kind = model_config.kv_bytes_per_token_by_kind(element_bytes)
    sliding_tokens = num_tokens
    if model_config.sliding_window is not None:
        sliding_tokens = min(num_tokens, model_config.sliding_window + chunk + BLOCK_SLACK)
    return by_kind.get("full_attention", 0) * num_tokens + by_kind.get("sliding_attention", 0) * sliding_tokens


def request_parts(model_config: Any, config: Any, prompt_lengths: list[int], element_bytes: int) -> dict[str, int]:
    """The big buffers of one request, in bytes: {what: size}. ``prompt_lengths`` one per prompt."""
    mc = model_config
    prompts, longest = len(prompt_lengths), max(prompt_lengths, default=1)
    new = config.max_new_tokens if config.max_new_tokens is not None else 0
    per_token = mc.kv_cache_bytes_per_token(element_bytes)
    beams = config.num_beams
    rows = prompts * (beams if beams > 1 else config.num_return_sequences)
    parts: dict[str, int] = {}
    if config.n_ctx is not None:  # what one stream needs at least (n_ctx + headroom); more wait for room
        rows = 1
        parts["streaming cache (n_ctx)"] = per_token * (config.n_ctx + min(config.n_ctx, PREFILL_CHUNK))
        longest = min(longest, PREFILL_CHUNK)
    elif mc.is_encoder_decoder:
        parts["decoder cache"] = per_token * rows * (new + 1)
        parts["cross-attention cache"] = mc.cross_cache_bytes_per_source_token(element_bytes) * prompts * longest
    elif beams > 1:  # FastSeq layout: the prompt once per sample, generated tokens per beam
        parts["KV cache"] = per_token * (prompts * longest + rows * new)
    else:  # the engine's layered slot cache
        parts["KV cache"] = rows * sequence_kv_bytes(mc, longest + new, element_bytes)
    # logits, probabilities and their sorted / cumulative copies per row (float32)
    parts["logits"] = 4 * rows * mc.vocab_size * (6 if beams > 1 else 4)
    if not config.use_cache:
        longest += new
    # prefill activations of the widest layer (float32)
    width = max(mc.hidden_size * 4, mc.intermediate_size * 2)
    parts["prefill activations"] = 4 * (rows if beams == 1 else prompts) * longest * width
    return parts


def check_request_memory(model_config: Any, config: Any, prompt_lengths: list[int], element_bytes: int,
                         device: Any = "cpu") -> int:
    """Raise MemoryLimitError if the request needs more than the limit; return the estimate."""
    parts = request_parts(model_config, config, prompt_lengths, element_bytes)
    total = sum(parts.values())
    if config.max_memory is not None:
        limit, what = parse_size(config.max_memory), "max_memory"
    else:
        limit, what = available_memory(device), "the memory available now"
        if limit is None:
            return total
    if total <= limit:
        return total
    largest = max(parts, key=parts.get)
    breakdown = ", ".join(f"{name} {format_size(size)}" for name, size in parts.items())
    raise MemoryLimitError(
        f"this request needs about {format_size(total)} ({breakdown}) but the limit is {format_size(limit)} "
        f"({what}): lower {_culprit(config, prompt_lengths, largest)}, or raise max_memory (--max-memory)"
    )


def _culprit(config: Any, prompt_lengths: list[int], largest: str) -> str:
    """The option that makes the request large, as the user named it."""
    if config.n_ctx is not None and "n_ctx" in largest:
        return f"n_ctx ({config.n_ctx})"
    if config.num_beams > 1:
        return f"num_beams ({config.num_beams})"
    if config.num_return_sequences > 1:
        return f"num_return_sequences ({config.num_return_sequences})"
    if len(prompt_lengths) > 1:
        return f"the number of prompts per batch ({len(prompt_lengths)}) or max_new_tokens ({config.max_new_tokens})"
    return f"max_new_tokens ({config.max_new_tokens}) or the prompt length ({max(prompt_lengths, default=0)})"
