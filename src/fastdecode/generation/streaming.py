"""Infinite (streaming) generation: engines that never run out of cache.

Both policies keep ``n_keep`` attention sinks and a window of ``n_ctx - n_keep`` tokens in one
sequence of the engine's slot cache (engine/slots.py), where a token's position is its index in
the sequence, and run every forward through the engine's ``StepPlan`` (so each layer's sliding
window, ALiBi and every family behave as in the engine). When a token arrives to a full cache:

* ``ShiftEngine`` (llama.cpp's context shift): ``seq_add`` moves the window tokens after the
  ``n_discard`` oldest ones ``n_discard`` positions down, over them, each key re-rotated by
  ``-n_discard`` with its layer's rotary table (K-shift: RoPE in either layout, partial rotary);
  then ``seq_rm`` drops the freed tail. ALiBi and window masks are rebuilt from positions, so
  nothing is recomputed. Learned absolute positions cannot move: re-evaluate only.
* ``ReevaluateEngine``: ``seq_rm`` of everything, then one prefill of the sinks and the newest
  tokens at fresh positions. Works for every position scheme and costs nothing before the cache
  is first full.

A chunk of a long input runs in one forward up to the policy's next drop (what the cache would
hold token by token), so chunked feeding equals feeding one token at a time. A shift rewrites the
kept window (O(window) per drop, as llama.cpp's K-shift): a larger ``n_discard`` amortizes it.

Both process a single sequence and expose ``feed`` plus the ``prefill``/``decode``/``drop_rows``
interface of the other engines, so the decode loop and the scorer use them unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import GenerationConfig
from ..engine.plan import StepPlan, attention_terms
from ..engine.slots import BLOCK_SIZE, SlotCache
from ..errors import InvalidOptionError

MAX_CHUNK = 512  # tokens per forward when feeding long inputs


class _StreamingEngineBase:
    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int):
        cfg = model.config
        self.model = model
        self.n_ctx, self.n_keep, self.n_discard = n_ctx, n_keep, n_discard
        self.cache = SlotCache(cfg.num_layers, -(-n_ctx // BLOCK_SIZE), cfg.num_kv_heads, cfg.head_dim,
                               model.dtype, model.device, BLOCK_SIZE)
        self.windows, self.score_bias = attention_terms(model)
        self.table: list[int] = []  # the one sequence's blocks
        self.tokens: list[int] = []  # what the cache holds, in order (token i at position i)
        self.next_position = 0  # tokens fed in the whole stream

    def make_room(self) -> None:
        """The cache is full and a token arrives: apply the policy."""
        raise NotImplementedError

    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool) -> Iterator[torch.Tensor]:
        """Feed tokens [N] through the policy; yield logits per chunk ([T, V], or [1, V] for the
        chunk's last token when not ``all_logits``)."""
        done = 0
        while done < tokens.shape[0]:
            if len(self.tokens) == self.n_ctx:
                self.make_room()
            size = min(tokens.shape[0] - done, self.n_ctx - len(self.tokens), MAX_CHUNK)
            yield self._forward(tokens[done : done + size].tolist(), all_logits)
            self.next_position += size
            done += size

    def _forward(self, chunk: list[int], all_logits: bool) -> torch.Tensor:
        """Append ``chunk`` to the sequence in one forward -> logits [T or 1, V]."""
        device, start = self.model.device, len(self.tokens)
        self.table = self.cache.writable(self.table, start, start + len(chunk))
        plan = StepPlan.for_rows(self.cache, [(self.table, start, len(chunk))], self.windows, self.score_bias,
                                 self.model.dtype)
        positions = torch.arange(start, start + len(chunk), device=device)[None]  # [1, T]
        tokens = torch.tensor(chunk, dtype=torch.long, device=device)[None]  # [1, T]
        self.tokens += chunk
        return self.model.forward(tokens, positions, plan, None, all_logits)[0]

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
    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int):
        cfg = model.config
        if cfg.position_kind == "learned":
            raise InvalidOptionError(
                f"{cfg.architecture} uses learned absolute positions, which cannot be shifted: "
                "use policy='reevaluate'"
            )
        super().__init__(model, n_ctx, n_keep, n_discard)
        self.ropes = model.layer_ropes if cfg.position_kind == "rope" else None
        self.shift = 0  # tokens dropped so far

    def _rotate(self, layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
        return self.ropes[layer].rotate_by(keys, delta)  # keys [1, Hkv, N, D]

    def make_room(self) -> None:
        """seq_add(-n_discard) of the window after the dropped tokens, then seq_rm of the tail."""
        n, first_kept = len(self.tokens), self.n_keep + self.n_discard
        self.table = self.cache.seq_add(self.table, first_kept, n, -self.n_discard,
                                        self._rotate if self.ropes is not None else None)
        self.table = self.cache.seq_rm(self.table, n - self.n_discard)
        self.tokens = self.tokens[: self.n_keep] + self.tokens[first_kept:]
        self.shift += self.n_discard


class ReevaluateEngine(_StreamingEngineBase):
    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int):
        cfg = model.config
        if cfg.position_kind == "learned" and n_ctx > cfg.max_position_embeddings:
            raise InvalidOptionError(
                f"n_ctx={n_ctx} exceeds the {cfg.max_position_embeddings} learned positions of {cfg.architecture}"
            )
        super().__init__(model, n_ctx, n_keep, n_discard)
        self.rebuilds = 0

    def make_room(self) -> None:
        """seq_rm of everything; prefill the sinks and all but the ``n_discard`` oldest window tokens."""
        kept = self.tokens[: self.n_keep] + self.tokens[self.n_keep + self.n_discard :]
        self.table = self.cache.seq_rm(self.table, 0)
        self.tokens = []
        self.rebuilds += 1
        for begin in range(0, len(kept), MAX_CHUNK):
            self._forward(kept[begin : begin + MAX_CHUNK], all_logits=False)


def streaming_engine(model, config: GenerationConfig):
    """The engine for a config with ``n_ctx`` set."""
    if config.policy == "shift":
        return ShiftEngine(model, config.n_ctx, config.n_keep, config.discard_count)
    return ReevaluateEngine(model, config.n_ctx, config.n_keep, config.discard_count)
