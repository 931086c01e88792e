"""Infinite (streaming) generation: engines that never run out of cache.

Two policies, both keeping ``n_keep`` attention sinks and a window of ``n_ctx - n_keep`` slots:

* ``ShiftEngine``: when the cache is full, drop ``n_discard`` window tokens and move the rest
  closer by re-indexing positions, without recomputing anything (``cache/ring.py``). Needs a
  relative position scheme: RoPE (either layout, partial rotary) or ALiBi.
* ``ReevaluateEngine``: when the cache is full, keep the sinks and the newest tokens, and rebuild
  the cache by one prefill over them at fresh positions. Works for every position scheme,
  learned absolute positions included, and costs nothing before the cache is first full.

Both process a single sequence and expose ``feed`` (chunked, through the policy) plus the
``prefill``/``decode``/``drop_rows`` interface of the other engines, so the decode loop and the
scorer use them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..cache.ring import StreamingCache
from ..config import GenerationConfig
from ..errors import InvalidOptionError
from .step import CachedEngine

MAX_CHUNK = 512  # tokens per forward when feeding long inputs


class _StreamingEngineBase:
    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int):
        self.model = model
        self.n_ctx, self.n_keep, self.n_discard = n_ctx, n_keep, n_discard

    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        """Feed tokens [N] through the policy; yield logits per chunk ([T, V], or [1, V] for the
        chunk's last token when not ``all_logits``)."""
        raise NotImplementedError

    def feed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed tokens [N]; logits of the last one [V]."""
        logits = None
        for logits in self.feed_chunks(tokens, all_logits=False):
            pass
        return logits[-1]

    # The engine interface of generation/step.py (batch of one; positions are the engine's own).
    def prefill(self, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if tokens.shape[0] != 1:
            raise InvalidOptionError("streaming generation runs one sequence at a time")
        return self.feed(tokens[0][valid[0]])[None]  # [1, V]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.feed(tokens)[None]  # [1, V]

    def drop_rows(self, rows: torch.Tensor) -> None:
        pass  # a single sequence: when it finishes, the loop ends


class ShiftEngine(_StreamingEngineBase):
    """``headroom``: extra ring slots so that chunks of ``headroom + 1`` tokens go through one
    forward with token-by-token semantics (used to score long texts fast)."""

    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int, headroom: int = 0):
        super().__init__(model, n_ctx, n_keep, n_discard)
        cfg = model.config
        if cfg.position_kind == "learned":
            raise InvalidOptionError(
                f"{cfg.architecture} uses learned absolute positions, which cannot be shifted: "
                "use policy='reevaluate'"
            )
        ropes = model.layer_ropes if cfg.position_kind == "rope" else None
        self.cache = StreamingCache(cfg.num_layers, cfg.num_kv_heads, n_ctx, n_keep, n_discard, cfg.head_dim,
                                    model.dtype, model.device, ropes, headroom)
        self.next_position = 0  # absolute position of the next token in the stream

    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        """A long input goes through a copy of the cache with headroom, in chunks of up to
        MAX_CHUNK tokens (without headroom a full ring with n_discard=1 takes one token per
        forward); the cache is copied back without headroom after, so decoding stays unmasked."""
        count = tokens.shape[0]
        if count <= self.cache.chunk_limit() or self.cache.ring_size > self.cache.window:
            yield from self._feed(tokens, all_logits)
            return
        self.cache = self.cache.resized(headroom=min(count, self.n_ctx, MAX_CHUNK) - 1)
        try:
            yield from self._feed(tokens, all_logits)
        finally:
            self.cache = self.cache.resized(headroom=0)

    def _feed(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        cache, device = self.cache, self.model.device
        done = 0
        while done < tokens.shape[0]:
            size = min(tokens.shape[0] - done, cache.chunk_limit(), MAX_CHUNK)
            chunk = tokens[done : done + size].to(device)
            cache.reserve(list(range(self.next_position, self.next_position + size)))
            positions = torch.arange(self.next_position, self.next_position + size, device=device)
            mask = cache.mask(positions, self.model.dtype)
            yield self.model.forward(chunk[None], positions[None], cache, mask, all_logits)[0]
            done += size
            self.next_position += size


class ReevaluateEngine(_StreamingEngineBase):
    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int):
        super().__init__(model, n_ctx, n_keep, n_discard)
        cfg = model.config
        if cfg.position_kind == "learned" and n_ctx > cfg.max_position_embeddings:
            raise InvalidOptionError(
                f"n_ctx={n_ctx} exceeds the {cfg.max_position_embeddings} learned positions of {cfg.architecture}"
            )
        self.engine = CachedEngine(model, 1, n_ctx)
        self.tokens: list[int] = []  # what the cache holds, in order
        self.rebuilds = 0

    def rebuild(self) -> None:
        """Keep the sinks and all but the ``n_discard`` oldest window tokens; prefill them anew."""
        kept = self.tokens[: self.n_keep] + self.tokens[self.n_keep + self.n_discard :]
        self.engine.cache.length = 0
        self.engine.cache.has_padding = False
        self.tokens = []
        self.rebuilds += 1
        for _ in self._prefill(torch.tensor(kept, dtype=torch.long), all_logits=False):
            pass

    def _prefill(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        device = self.model.device
        for begin in range(0, tokens.shape[0], MAX_CHUNK):
            chunk = tokens[begin : begin + MAX_CHUNK].to(device)[None]  # [1, T]
            start = len(self.tokens)
            positions = torch.arange(start, start + chunk.shape[1], device=device)[None]  # [1, T]
            logits = self.engine.prefill(chunk, torch.ones_like(chunk, dtype=torch.bool), positions, all_logits)
            self.tokens += chunk[0].tolist()
            yield logits[0] if all_logits else logits

    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        done = 0
        while done < tokens.shape[0]:
            if len(self.tokens) == self.n_ctx:
                self.rebuild()
            size = min(tokens.shape[0] - done, self.n_ctx - len(self.tokens))
            yield from self._prefill(tokens[done : done + size], all_logits)
            done += size


def streaming_engine(model, config: GenerationConfig, headroom: int = 0):
    """The engine for a config with ``n_ctx`` set (``headroom``: see ShiftEngine)."""
    if config.policy == "shift":
        return ShiftEngine(model, config.n_ctx, config.n_keep, config.discard_count, headroom)
    return ReevaluateEngine(model, config.n_ctx, config.n_keep, config.discard_count)
