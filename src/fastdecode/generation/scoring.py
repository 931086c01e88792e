"""Per-token negative log-likelihood of a token sequence, in chunks (bounded memory), outside the
engine: through a streaming cache (``score(..., n_ctx=...)``), and the plain cached pass the tests
compare the engine's scoring sequences with (engine/scoring.py runs ``Generator.score``, perplexity
and the server's echo)."""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from .step import CachedEngine
from .streaming import streaming_engine

CHUNK = 512


def score_tokens(model, ids: list[int], config: GenerationConfig) -> list[float]:
    """NLL of ids[1:], each given everything before it (or, with ``config.n_ctx``, what the
    streaming cache still holds). Logits exist for one chunk at a time, so memory stays bounded
    by ``chunk * vocab`` whatever the length."""
    tokens = torch.tensor(ids, dtype=torch.long)  # [N]
    inputs, targets = tokens[:-1], tokens[1:].to(model.device)
    losses: list[torch.Tensor] = []
    done = 0
    with torch.inference_mode():
        for logits in _chunk_logits(model, inputs, config):  # [T, V] per chunk
            size = logits.shape[0]
            losses.append(torch.nn.functional.cross_entropy(logits.float(), targets[done : done + size],
                                                            reduction="none"))
            done += size
    return torch.cat(losses).tolist()


def _chunk_logits(model, inputs: torch.Tensor, config: GenerationConfig):
    if config.n_ctx is not None:
        engine = streaming_engine(model, config)
        yield from engine.feed_chunks(inputs, all_logits=True, prompt=False)  # (as the stream ran them before)
        return
    engine = CachedEngine(model, 1, inputs.shape[0])
    for begin in range(0, inputs.shape[0], CHUNK):
        chunk = inputs[begin : begin + CHUNK].to(model.device)[None]  # [1, T]
        positions = torch.arange(begin, begin + chunk.shape[1], device=model.device)[None]  # [1, T]
        yield engine.prefill(chunk, torch.ones_like(chunk, dtype=torch.bool), positions, all_logits=True)[0]


def token_logprobs_of(model, ids: list[int], config: GenerationConfig,
                      top: int = 0) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """Log-probability of each of ids[1:] given the tokens before it (``-score_tokens``), and with
    ``top`` > 0 the ``top`` most likely (token id, log-probability) pairs at each position; chunked
    as ``score_tokens``."""
    tokens = torch.tensor(ids, dtype=torch.long)  # [N]
    inputs, targets = tokens[:-1], tokens[1:].to(model.device)
    chosen: list[float] = []
    best: list[list[tuple[int, float]]] = []
    done = 0
    with torch.inference_mode():
        for logits in _chunk_logits(model, inputs, config):  # [T, V] per chunk
            size = logits.shape[0]
            logprobs = logits.float().log_softmax(dim=-1)  # [T, V]
            chosen += logprobs.gather(1, targets[done : done + size, None])[:, 0].tolist()
            if top > 0:
                values, index = logprobs.topk(top, dim=-1)  # [T, top]
                best += [list(zip(i, v)) for i, v in zip(index.tolist(), values.tolist())]
            else:
                best += [[] for _ in range(size)]
            done += size
    return chosen, best
