"""``use_cache=False``: the seed's vanilla recipe, outside the engine, kept as the reference.

Every step re-runs the model over the whole sequence (decoder-only: the left-padded prompt and
every token generated so far; encoder-decoder: the encoder over the source and the decoder over the
whole target), O(n^2) work per sequence. Nothing here is a production path: the engine's cached
sequences must equal it (the parity tests), and the benchmarks show what caching buys. Rows that
finish (EOS, length, a stop string the caller reports) leave the batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from ..cache.view import NoCache
from ..config import GenerationConfig
from ..constraints import CompiledGrammar
from ..engine.cross import EncodedSources, right_pad
from ..engine.sequence import SequenceResult
from ..layers.attention import build_attention_mask
from ..layers.products import Products
from ..decoding.sampling import TokenSelector


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


class ReferenceLoop:
    """Iterate to run; each step yields [(sequence index, new token)] for the rows still active.
    Between steps the consumer may call ``stop(index)``. ``results``: each sequence's new tokens
    (EOS included, as transformers returns it)."""

    def __init__(self, model, prompts: list[list[int]], config: GenerationConfig, eos_ids: list[int],
                 row_seeds: list[int] | None = None, grammar: CompiledGrammar | None = None):
        self.model, self.prompts, self.config, self.row_seeds = model, prompts, config, row_seeds
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
        if cfg.max_new_tokens == 0:
            for result in self.results:
                result.finish_reason = "length"
            return
        encoder_decoder = model.config.is_encoder_decoder
        recompute = (EncoderDecoderRecompute if encoder_decoder else DecoderRecompute)(model, self.prompts)
        history = [[model.config.decoder_start_token_id]] * len(self.prompts) if encoder_decoder else self.prompts
        with torch.inference_mode():
            self.selector.start(history, model.device, self.prompts if encoder_decoder else None, self.row_seeds)
            active = list(range(len(self.prompts)))  # sequence index of each batch row
            for step in itertools.count() if cfg.max_new_tokens is None else range(cfg.max_new_tokens):
                new_tokens = self.selector.select(recompute.logits(), step)  # [B]
                events = []
                for token, index in zip(new_tokens.tolist(), active):
                    result = self.results[index]
                    result.tokens.append(token)
                    events.append((index, token))
                    if token in self.eos_ids:
                        result.finish_reason = "eos"
                    elif cfg.max_new_tokens is not None and len(result.tokens) >= cfg.max_new_tokens:
                        result.finish_reason = "length"
                yield events
                keep = [row for row, index in enumerate(active) if self.results[index].finish_reason is None]
                if not keep:
                    return
                if len(keep) < len(active):
                    rows = torch.tensor(keep, dtype=torch.long, device=model.device)
                    recompute.keep_rows(rows)
                    self.selector.select_rows(rows)
                    new_tokens, active = new_tokens[rows], [active[row] for row in keep]
                recompute.append(new_tokens)

    def run(self) -> list[SequenceResult]:
        for _ in self:
            pass
        return self.results


class DecoderRecompute:
    """The left-padded prompts plus the generated columns, run whole at every step."""

    def __init__(self, model, prompts: list[list[int]]):
        self.model = model
        self.tokens, self.valid, self.positions = left_pad(prompts, model.device)  # [B, T] each
        self.prompt_columns = self.tokens.shape[1]

    def logits(self) -> torch.Tensor:
        """-> logits [B, V] of every row's next token."""
        B, T = self.tokens.shape
        mask = build_attention_mask(self.valid, 0, T, self.model.dtype)
        roles = [column < self.prompt_columns for _ in range(B) for column in range(T)]  # [B * T], row-major
        products = Products.of_rows(roles, torch.get_num_threads(), self.tokens.device,
                                    kernels=self.model.kernels)  # as the engine's rows
        return self.model.forward(self.tokens, self.positions, NoCache.of_model(self.model, products, mask, self.positions))[:, -1]

    def append(self, tokens: torch.Tensor) -> None:
        """tokens [B]: one new column."""
        self.tokens = torch.cat([self.tokens, tokens[:, None]], dim=1)  # [B, T+1]
        self.valid = torch.cat([self.valid, torch.ones_like(tokens[:, None], dtype=torch.bool)], dim=1)
        self.positions = torch.cat([self.positions, self.positions[:, -1:] + 1], dim=1)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.tokens, self.valid, self.positions = (t.index_select(0, rows) for t in
                                                   (self.tokens, self.valid, self.positions))


class EncoderDecoderRecompute:
    """No cache at all: every step re-encodes the source and re-decodes the whole target."""

    def __init__(self, model, sources: list[list[int]]):
        self.model = model
        self.source, self.source_valid, self.source_positions = right_pad(sources, model.device)
        start = model.config.decoder_start_token_id
        self.target = torch.full((len(sources), 1), start, dtype=torch.long, device=model.device)  # [B, 1]

    def logits(self) -> torch.Tensor:
        model = self.model
        cross = EncodedSources.from_padded(model, self.source, self.source_valid, self.source_positions)
        B, T = self.target.shape
        positions = torch.arange(T, device=self.target.device).expand(B, T)  # [B, T]
        bias = model.decoder_self_bias(T)  # [1, H|1, T, T]
        roles = [column == 0 for _ in range(B) for column in range(T)]  # [B * T]: the start token is the prompt
        products = Products.of_rows(roles, torch.get_num_threads(), self.target.device, kernels=model.kernels)
        return model.decode(self.target, positions, NoCache(products, bias), cross)[:, -1]

    def append(self, tokens: torch.Tensor) -> None:
        self.target = torch.cat([self.target, tokens[:, None]], dim=1)  # [B, T+1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.target = self.target.index_select(0, rows)
        self.source, self.source_valid = self.source.index_select(0, rows), self.source_valid.index_select(0, rows)


__all__ = ["DecoderRecompute", "EncoderDecoderRecompute", "ReferenceLoop", "left_pad"]
