"""Encoder-decoder generation outside the scheduler: beam search, and the naive reference.

The seed (bart-incremental-decoding) gives three recipes. Its first, every step running the encoder
over the source and the decoder over the whole target (N*M + M(M+1)/2 token-passes), is
``EncoderDecoderRecompute`` (``use_cache=False``), kept as the reference. Its last, the encoder
hoisted out of the loop, the cross-attention K/V projected once and the decoder's self-attention
K/V cached (N + M token-passes), is what every cached path runs: greedy and sampling requests in
the engine's scheduler (engine/cross.py), beam search here (``EncoderDecoderBeamEngine``).

Beam search is decoder-only beam search (``DecoderBeamEngine``: the slot cache's verbs, every
forward through a ``StepPlan``) whose "prompt" is the decoder start token, plus the sources: the
encoder runs once per source, each source's cross K/V are stored once and read once per step for
all of its beams (``EncodedSources``, FastSeq), and a beam reorder moves decoder blocks only.
"""

from __future__ import annotations

import torch

from ..engine.cross import EncodedSources, decoder_score_bias, right_pad
from ..engine.plan import StepPlan
from ..layers.products import Products
from .beam import DecoderBeamEngine
from .step import Started

__all__ = ["EncoderDecoderBeamEngine", "EncoderDecoderRecompute", "right_pad", "start_beam_encoder_decoder",
           "start_encoder_decoder"]


def start_encoder_decoder(model, sources: list[list[int]], config) -> Started:
    """Encode the sources, then run the decoder start token (one beam per source: plain decoding)."""
    if config.use_cache:
        return start_beam_encoder_decoder(model, sources, config, num_beams=1)
    engine = EncoderDecoderRecompute(model)
    logits = engine.prefill(*right_pad(sources, model.device))
    next_positions = torch.ones(len(sources), dtype=torch.long, device=model.device)
    return Started(engine, logits, next_positions, [[model.config.decoder_start_token_id]] * len(sources))


def start_beam_encoder_decoder(model, sources: list[list[int]], config, num_beams: int | None = None) -> Started:
    """Beam search start: encode the B sources once, run the start token once per source -> logits
    [B, V] (every beam of a sample is the same so far); the K beams fork at the first decode."""
    engine = EncoderDecoderBeamEngine(model, num_beams or config.num_beams, config.max_new_tokens)
    logits = engine.start(sources)
    next_positions = torch.ones(len(sources), dtype=torch.long, device=model.device)
    return Started(engine, logits, next_positions, [[model.config.decoder_start_token_id]] * len(sources))


class EncoderDecoderBeamEngine(DecoderBeamEngine):
    """``DecoderBeamEngine`` over the decoder, with each sample's source encoded once.

    ``start(sources)`` encodes every source (one encoder call) and stores its cross K/V once;
    then, as for a decoder-only prompt, the decoder start token runs once per sample into its own
    sequence of the slot cache and the K beams are ``seq_cp`` forks of it. Decoder self-attention
    goes through the engine's ``StepPlan`` (T5's relative bias as the plan's position bias, BART's
    learned positions in the embedding), cross-attention through ``EncodedSources`` with the beams
    of a sample folded into its query axis."""

    def __init__(self, model, num_beams: int, max_new_tokens: int):
        super().__init__(model, num_beams, max_new_tokens)
        self.score_bias = decoder_score_bias(model)
        self.sources: EncodedSources | None = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Right-padded sources: tokens, valid [B, S] (positions unused) -> logits [B, V]."""
        return self.start([row[ok].tolist() for row, ok in zip(tokens, valid)])

    def start(self, sources: list[list[int]]) -> torch.Tensor:
        """Encode the sources once, run the start token once per source -> logits [B, V]."""
        self.sources = EncodedSources.encode(self.model, sources)
        logits = super().start([[self.model.config.decoder_start_token_id]] * len(sources))
        self.shared_nbytes += self.sources.nbytes  # stored once per sample, whatever the beam count
        return logits

    def _run_model(self, tokens: torch.Tensor, positions: torch.Tensor, plan: StepPlan, logits_at: torch.Tensor,
                   num_rows: int) -> torch.Tensor:
        cross = self.sources.folded(num_rows // self.sources.num_sources)  # rows: one sample's beams side by side
        return self.model.decode(tokens, positions, plan, None, cross, logits_at=logits_at)

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Only these samples [B'] go on: their beams' blocks and their sources' cross K/V."""
        super().keep_samples(samples)
        self.sources.keep(samples)

    def drop_rows(self, rows: torch.Tensor) -> None:
        """Plain decoding (one beam per source): finished rows leave the batch."""
        self.keep_samples(rows)


class EncoderDecoderRecompute:
    """No cache at all: every step re-encodes the source and re-decodes the whole target."""

    def __init__(self, model):
        self.model = model
        self.source = self.valid = self.source_positions = None
        self.target = self.target_positions = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.source, self.valid, self.source_positions = tokens, valid, positions
        B = tokens.shape[0]
        start = self.model.config.decoder_start_token_id
        self.target = torch.full((B, 1), start, dtype=torch.long, device=tokens.device)  # [B, 1]
        self.target_positions = torch.zeros_like(self.target)
        return self._run()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.target = torch.cat([self.target, tokens[:, None]], dim=1)  # [B, T+1]
        self.target_positions = torch.cat([self.target_positions, positions[:, None]], dim=1)
        return self._run()

    def _run(self) -> torch.Tensor:
        model = self.model
        cross = EncodedSources.from_padded(model, self.source, self.valid, self.source_positions)  # every step
        B, T = self.target.shape
        bias = model.decoder_self_bias(T)  # [1, H|1, T, T]
        roles = [column == 0 for _ in range(B) for column in range(T)]  # [B * T]: the start token is the prompt
        products = Products.of_rows(roles, torch.get_num_threads(), self.target.device, kernels=model.kernels)
        return model.decode(self.target, self.target_positions, None, bias, cross, products=products)[:, -1]

    def drop_rows(self, rows: torch.Tensor) -> None:
        self.source = self.source.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.target = self.target.index_select(0, rows)
        self.target_positions = self.target_positions.index_select(0, rows)
