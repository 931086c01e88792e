"""The token-by-token loop for greedy decoding and sampling, over a batch of prompts.

Prompts are left-padded so that every row writes its next token into the same cache slot;
each row keeps its own positions. Rows that finish (EOS, length, a stop string reported by the
caller) are dropped from the batch so they stop costing work.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from ..config import GenerationConfig
from ..engine.sequence import SequenceResult  # noqa: F401 (the result type, here for the loops' callers)
from ..constraints import CompiledGrammar
from .sampling import TokenSelector
from .step import CachedEngine, RecomputeEngine, Started




def left_pad(prompts: list[list[int]], device: torch.device, pad_id: int = 0):
    """-> tokens, valid, positions [B, L]; positions count real tokens only (0 under padding)."""
    B, L = len(prompts), max(len(p) for p in prompts)
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    valid = torch.zeros((B, L), dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, L - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        valid[row, L - len(prompt):] = True
    positions = (valid.cumsum(dim=1) - 1).clamp(min=0)
    return tokens.to(device), valid.to(device), positions.to(device)


def start_decoder_only(model, prompts: list[list[int]], config: GenerationConfig) -> Started:
    """Left-pad the prompts and prefill them in one forward."""
    tokens, valid, positions = left_pad(prompts, model.device)
    engine = _decoder_engine(model, config, *tokens.shape)
    return Started(engine, engine.prefill(tokens, valid, positions), positions[:, -1] + 1, prompts)


def _decoder_engine(model, config: GenerationConfig, batch_size: int, prompt_length: int):
    if not config.use_cache:
        return RecomputeEngine(model)
    return CachedEngine(model, batch_size, prompt_length + config.max_new_tokens)


def engine_starter(model):
    """The one hook between model kinds: encoder-decoder models start by encoding the source."""
    if model.config.is_encoder_decoder:
        from .encdec import start_encoder_decoder

        return start_encoder_decoder
    return start_decoder_only


class DecodeLoop:
    """Iterate to run; each step yields [(sequence index, new token)] for the rows still active.

    Between steps the consumer may call ``stop(index)`` (e.g. a stop string was produced).
    ``results`` holds each sequence's new tokens (EOS included, as transformers returns it).
    """

    def __init__(self, model, prompts: list[list[int]], config: GenerationConfig, eos_ids: list[int],
                 row_seeds: list[int] | None = None, grammar: CompiledGrammar | None = None):
        self.model = model
        self.row_seeds = row_seeds  # each row's sampling seed (see sampling.py), or None
        self.prompts = prompts
        self.config = config
        self.eos_ids = set(eos_ids)
        self.results = [SequenceResult() for _ in prompts]
        self.selector = TokenSelector(config, eos_ids, model.config.vocab_size, model.device,
                                      forced_bos=getattr(model.config, "forced_bos_token_id", None),
                                      forced_eos=getattr(model.config, "forced_eos_token_id", ()),
                                      grammar=grammar)

    def stop(self, index: int, reason: str = "stop") -> None:
        if self.results[index].finish_reason is None:
            self.results[index].finish_reason = reason

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        cfg, model = self.config, self.model
        device = model.device
        if cfg.max_new_tokens == 0:
            for result in self.results:
                result.finish_reason = "length"
            return
        with torch.inference_mode():
            started = engine_starter(model)(model, self.prompts, cfg)
            engine, logits, next_positions, history = started
            sources = self.prompts if model.config.is_encoder_decoder else None
            self.selector.start(history, device, sources, self.row_seeds)
            active = list(range(len(self.prompts)))  # sequence index of each batch row
            steps = itertools.count() if cfg.max_new_tokens is None else range(cfg.max_new_tokens)
            for step in steps:
                new_tokens = self.selector.select(logits, step)  # [B]
                events = []
                for row_token, index in zip(new_tokens.tolist(), active):
                    result = self.results[index]
                    result.tokens.append(row_token)
                    events.append((index, row_token))
                    if row_token in self.eos_ids:
                        result.finish_reason = "eos"
                    elif cfg.max_new_tokens is not None and len(result.tokens) >= cfg.max_new_tokens:
                        result.finish_reason = "length"
                yield events
                keep = [row for row, index in enumerate(active) if self.results[index].finish_reason is None]
                if not keep:
                    return
                if len(keep) < len(active):
                    rows = torch.tensor(keep, dtype=torch.long, device=device)
                    engine.drop_rows(rows)
                    self.selector.select_rows(rows)
                    new_tokens, next_positions = new_tokens[rows], next_positions[rows]
                    active = [active[row] for row in keep]
                logits = engine.decode(new_tokens, next_positions)
                next_positions = next_positions + 1

    def run(self) -> list[SequenceResult]:
        for _ in self:
            pass
        return self.results
