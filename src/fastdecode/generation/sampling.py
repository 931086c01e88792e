"""Choosing the next token from logits: the processor chain, then argmax or a seeded draw."""

from __future__ import annotations

import torch

from ..config import GenerationConfig
from .processors import apply_repetition_penalty, apply_top_k, apply_top_p, force_tokens, suppress_tokens


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
        self.generator: torch.Generator | None = None
        if config.is_sampling:
            self.generator = torch.Generator(device=device)
            if config.seed is not None:
                self.generator.manual_seed(config.seed)
            else:
                self.generator.seed()

    def start(self, prompts: list[list[int]], device: torch.device) -> None:
        """Record prompt tokens (only needed by the repetition penalty)."""
        if self.config.repetition_penalty == 1.0:
            return
        self.seen = torch.zeros(len(prompts), self.vocab_size, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            self.seen[row, torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def keep_rows(self, rows: torch.Tensor) -> None:
        if self.seen is not None:
            self.seen = self.seen.index_select(0, rows)

    def select(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """logits [B, V] -> next tokens [B] (long)."""
        cfg = self.config
        logits = logits.float()
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, cfg.repetition_penalty)
        if num_generated < cfg.min_new_tokens and self.eos_ids.numel():
            logits = suppress_tokens(logits, self.eos_ids)
        if num_generated == 0 and self.forced_bos is not None:
            logits = force_tokens(logits, self.forced_bos)
        if self.forced_eos is not None and num_generated == (cfg.max_new_tokens or 0) - 1:
            logits = force_tokens(logits, self.forced_eos)
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
        if self.seen is not None:
            self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True
        return tokens
