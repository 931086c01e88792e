"""Choosing the next token from logits: the processor chain, then argmax or a seeded draw."""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from .processors import (
    PAD,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    encoder_no_repeat_ngram_mask,
    force_tokens,
    no_repeat_ngram_mask,
    suppress_tokens,
)


class TokenSelector:
    """Applies the configured processors and picks one token per row.

    Holds the per-row "seen tokens" mask for the repetition penalty and the seeded
    ``torch.Generator`` for sampling; everything stays on the model's device.
    """

    def __init__(self, config: GenerationConfig, eos_ids: list[int], vocab_size: int, device: torch.device,
                 forced_bos: int | None = None, forced_eos: list[int] | tuple = ()):
        self.config = config
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        # A model config's forced first / last token (BART-family configs set them), as transformers applies them.
        self.forced_bos = None if forced_bos is None else torch.tensor([forced_bos], dtype=torch.long, device=device)
        self.forced_eos = torch.tensor(list(forced_eos), dtype=torch.long, device=device) if forced_eos else None
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None
        # Token history [N, L] (left-padded with PAD) and sources [N, S] for n-gram blocking.
        self.history: torch.Tensor | None = None
        self.sources: torch.Tensor | None = None
        self.generator: torch.Generator | None = None
        if config.is_sampling:
            self.generator = torch.Generator(device=device)
            if config.seed is not None:
                self.generator.manual_seed(config.seed)
            else:
                self.generator.seed()

    def start(self, prompts: list[list[int]], device: torch.device,
              sources: list[list[int]] | None = None) -> None:
        """Record prompt tokens (repetition penalty, n-gram blocking) and, for encoder no-repeat-n-gram
        blocking, the encoder-decoder sources."""
        cfg = self.config
        if cfg.no_repeat_ngram_size > 0 or cfg.encoder_no_repeat_ngram_size > 0:
            self.history = pad_rows(prompts, device)
        if cfg.encoder_no_repeat_ngram_size > 0 and sources is not None:
            self.sources = pad_rows(sources, device)
        if cfg.repetition_penalty == 1.0:
            return
        self.seen = torch.zeros(len(prompts), self.vocab_size, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            self.seen[row, torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep (or, for beam search, reorder and repeat) rows of the per-row state."""
        if self.seen is not None:
            self.seen = self.seen.index_select(0, rows)
        if self.history is not None:
            self.history = self.history.index_select(0, rows)
        if self.sources is not None:
            self.sources = self.sources.index_select(0, rows)

    def record(self, tokens: torch.Tensor) -> None:
        """Append the chosen tokens [N] to the per-row state."""
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True
        if self.history is not None:
            self.history = torch.cat([self.history, tokens[:, None]], dim=1)  # [N, L+1]

    def process(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """The processors shared by every strategy (transformers' order), on logits or, for beam
        search, log-probabilities [N, V] -> [N, V]."""
        cfg = self.config
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, cfg.repetition_penalty)
        if cfg.no_repeat_ngram_size > 0:
            banned = no_repeat_ngram_mask(self.history, cfg.no_repeat_ngram_size, logits.shape[-1])
            logits = logits.masked_fill(banned, float("-inf"))
        if cfg.encoder_no_repeat_ngram_size > 0 and self.sources is not None:
            banned = encoder_no_repeat_ngram_mask(self.sources, self.history, cfg.encoder_no_repeat_ngram_size,
                                                  logits.shape[-1])
            logits = logits.masked_fill(banned, float("-inf"))
        if num_generated < cfg.min_new_tokens and self.eos_ids.numel():
            logits = suppress_tokens(logits, self.eos_ids)
        if num_generated == 0 and self.forced_bos is not None:
            logits = force_tokens(logits, self.forced_bos)
        if self.forced_eos is not None and cfg.max_new_tokens is not None and num_generated == cfg.max_new_tokens - 1:
            logits = force_tokens(logits, self.forced_eos)
        return logits

    def select(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """logits [B, V] -> next tokens [B] (long)."""
        cfg = self.config
        logits = self.process(logits.float(), num_generated)
        if cfg.is_sampling:
            if cfg.temperature != 1.0:
                logits = logits / cfg.temperature
            if cfg.top_k:
                logits = apply_top_k(logits, cfg.top_k)
            if cfg.top_p < 1.0:
                logits = apply_top_p(logits, cfg.top_p)
            probs = logits.softmax(dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            tokens = logits.argmax(dim=-1)
        self.record(tokens)
        return tokens


def pad_rows(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Token lists -> [N, L] long, left-padded with PAD (built once per generation, not per step)."""
    L = max(len(r) for r in rows)
    out = torch.full((len(rows), L), PAD, dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            out[index, L - len(row):] = torch.tensor(row, dtype=torch.long)
    return out.to(device)
