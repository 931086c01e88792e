"""Encoder-decoder beam search outside the scheduler, which Whisper still drives (speech/engine.py).

The seed (bart-incremental-decoding) gives three recipes. Its first, every step running the encoder
over the source and the decoder over the whole target (N*M + M(M+1)/2 token-passes), is
``EncoderDecoderRecompute`` (``use_cache=False``, generation/reference.py), kept as the reference. Its last, the encoder
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

from typing import NamedTuple

from ..engine.cross import EncodedSources, decoder_score_bias, right_pad
from ..engine.plan import StepPlan
from .beam import DecoderBeamEngine

__all__ = ["EncoderDecoderBeamEngine", "right_pad", "start_beam_encoder_decoder"]


class Started(NamedTuple):
    """A started beam search: the engine after its first forward, and where decoding resumes."""

    engine: "EncoderDecoderBeamEngine"
    logits: torch.Tensor  # [B, V] for the first new token
    next_positions: torch.Tensor  # [B] position of the token fed at the next decode
    history: list[list[int]]  # tokens the processors count as already seen


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
        return self.model.decode(tokens, positions, plan, cross, logits_at=logits_at)

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Only these samples [B'] go on: their beams' blocks and their sources' cross K/V."""
        super().keep_samples(samples)
        self.sources.keep(samples)

    def drop_rows(self, rows: torch.Tensor) -> None:
        """Plain decoding (one beam per source): finished rows leave the batch."""
        self.keep_samples(rows)
