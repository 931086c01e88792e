"""Encoder-decoder generation: the encoder once, the cross-attention K/V once, then decoder steps.

The seed (bart-incremental-decoding) gives three recipes. Its first, every step running the encoder
over the source and the decoder over the whole target (N*M + M(M+1)/2 token-passes), is
``EncoderDecoderRecompute`` (``use_cache=False``), kept as the reference. ``EncoderDecoderEngine``
is its last: the encoder hoisted out of the loop, the cross-attention K/V projected once, and the
decoder's self-attention K/V cached, so each step passes one token (N + M).

Greedy and sampling requests run in the engine's scheduler instead (engine/cross.py: the same
three model calls per request, batched with every other running request); the engines here serve
beam search (``start_beam_encoder_decoder``), the naive reference, and tests that drive one step
at a time.

Both engines have CachedEngine's interface (prefill / decode / keep_rows), so the decode loop,
the processors and the stop logic are shared with decoder-only models. ``prefill`` takes the
*source*; the decoder start token is fed inside it, at target position 0.

Sources are right-padded: every row's real tokens sit at positions 0..n-1, exactly as when the
source is alone, so positions ([1, S]) and T5's encoder bias are shared by the whole batch; the
padding is masked out of encoder self-attention and of every cross-attention. Targets need no
padding at all: every row starts with the same token at position 0 and grows one slot per step.
"""

from __future__ import annotations

import torch

from ..cache.cross import BeamCrossAttention, CrossAttentionCache
from ..cache.static import KVCache
from .step import Started


def right_pad(sources: list[list[int]], device: torch.device, pad_id: int = 0):
    """-> tokens [B, S], valid [B, S], positions [1, S] (the same 0..S-1 for every row)."""
    B, S = len(sources), max(len(s) for s in sources)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    valid = torch.zeros((B, S), dtype=torch.bool)
    for row, source in enumerate(sources):
        tokens[row, : len(source)] = torch.tensor(source, dtype=torch.long)
        valid[row, : len(source)] = True
    positions = torch.arange(S, dtype=torch.long)[None]  # [1, S]
    return tokens.to(device), valid.to(device), positions.to(device)


def start_encoder_decoder(model, sources: list[list[int]], config) -> Started:
    """Encode the sources, project the cross-attention K/V, run the decoder start token."""
    tokens, valid, positions = right_pad(sources, model.device)
    B = tokens.shape[0]
    # Slots for the start token and every generated token but the last (it is never fed back).
    if config.use_cache:
        engine = EncoderDecoderEngine(model, B, config.max_new_tokens)
    else:
        engine = EncoderDecoderRecompute(model)
    logits = engine.prefill(tokens, valid, positions)
    next_positions = torch.ones(B, dtype=torch.long, device=model.device)
    return Started(engine, logits, next_positions, [[model.config.decoder_start_token_id]] * B)


def start_beam_encoder_decoder(model, sources: list[list[int]], config) -> Started:
    """Beam search start: encode B sources and run the start token for B rows (all beams of a sample
    are identical so far), then give the decoder self-attention cache one row per beam while the
    cross-attention K/V stay once per source (beams fold into its query axis)."""
    tokens, valid, positions = right_pad(sources, model.device)
    B, K = tokens.shape[0], config.num_beams
    engine = EncoderDecoderEngine(model, B, config.max_new_tokens)
    logits = engine.prefill(tokens, valid, positions)  # [B, V]
    engine.cache.keep_rows(torch.arange(B, device=model.device).repeat_interleave(K))  # [B*K] rows
    engine.cross = BeamCrossAttention(engine.cross, K)
    next_positions = torch.ones(B, dtype=torch.long, device=model.device)
    return Started(engine, logits, next_positions, [[model.config.decoder_start_token_id]] * B)


def decoder_start_tokens(model, batch_size: int) -> torch.Tensor:
    return torch.full((batch_size,), model.config.decoder_start_token_id, dtype=torch.long, device=model.device)


def self_bias_rows(table: torch.Tensor, start: int, num_queries: int) -> torch.Tensor:
    """Rows start..start+T-1 of a decoder self-attention bias table [1, H|1, P, P] -> [1, H|1, T, start+T]."""
    end = start + num_queries
    return table[:, :, start:end, :end]


class EncoderDecoderEngine:
    """Encoder and cross-attention K/V once per call; the decoder's self-attention K/V in a KV cache."""

    def __init__(self, model, batch_size: int, capacity: int):
        cfg = model.config
        self.model = model
        self.cache = KVCache(cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim,
                             model.dtype, model.device)
        # Causal mask (plus T5's relative bias) for every target slot, built once; steps take rows of it.
        self.self_bias = model.decoder_self_bias(capacity)  # [1, H|1, P, P]
        self.cross: CrossAttentionCache | None = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Source tokens, valid [B, S], positions [1, S] -> logits [B, V] after the decoder start token."""
        model = self.model
        memory = model.encode(tokens, positions, valid)  # [B, S, C]
        self.cross = CrossAttentionCache.build(model.cross_kv, model.config.num_layers, memory, valid)
        B = tokens.shape[0]
        return self.decode(decoder_start_tokens(model, B), torch.zeros(B, dtype=torch.long, device=model.device))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [B] -> logits [B, V] for the next token of every row."""
        tokens, positions = tokens[:, None], positions[:, None]  # [B, 1]
        start = self.cache.append_slots(torch.ones_like(tokens, dtype=torch.bool), positions)
        bias = self_bias_rows(self.self_bias, start, 1)
        return self.model.decode(tokens, positions, self.cache, start, bias, self.cross)[:, -1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.cache.keep_rows(rows)
        self.cross.keep_rows(rows)

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Beam search: drop settled samples' source K/V (their beams go with the next ``keep_rows``)."""
        self.cross.keep_samples(samples)


class EncoderDecoderRecompute:
    """No cache at all: every step re-encodes the source and re-decodes the whole target."""

    def __init__(self, model):
        self.model = model
        self.source = self.valid = self.source_positions = None
        self.target = self.target_positions = None

    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.source, self.valid, self.source_positions = tokens, valid, positions
        B = tokens.shape[0]
        self.target = decoder_start_tokens(self.model, B)[:, None]  # [B, 1]
        self.target_positions = torch.zeros_like(self.target)
        return self._run()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.target = torch.cat([self.target, tokens[:, None]], dim=1)  # [B, T+1]
        self.target_positions = torch.cat([self.target_positions, positions[:, None]], dim=1)
        return self._run()

    def _run(self) -> torch.Tensor:
        model = self.model
        memory = model.encode(self.source, self.source_positions, self.valid)  # [B, S, C]
        cross = CrossAttentionCache.build(model.cross_kv, model.config.num_layers, memory, self.valid)
        T = self.target.shape[1]
        bias = model.decoder_self_bias(T)  # [1, H|1, T, T]
        return model.decode(self.target, self.target_positions, None, 0, bias, cross)[:, -1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.source = self.source.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)
        self.target = self.target.index_select(0, rows)
        self.target_positions = self.target_positions.index_select(0, rows)
