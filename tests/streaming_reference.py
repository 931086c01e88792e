"""The streaming shift policy by its definition, for tests: when the policy drops tokens, every kept
window key is rewritten (rotated by -n_discard per layer with that layer's RoPE table) and its
stored position moved back; queries then enter at their position in the shifted frame."""

from __future__ import annotations

import torch

from fastdecode.cache.ring import StreamingCache
from fastdecode.generation.streaming import ShiftEngine


class ExplicitShiftCache(StreamingCache):
    """The definition, literally: when the policy drops tokens, rewrite every kept window key
    rotated by -n_discard (RoPE) and move its stored position back; the query then enters at its
    position in the shifted frame, and attention is plain (no per-segment trickery)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.explicit_ropes = self.layer_ropes
        self.layer_ropes, self.rope_groups = None, []  # no sink frames here: every key moves into the query's frame

    def reserve(self, positions):
        (position,) = positions
        if self.sinks == self.n_keep and self.window_count == self.window:
            window = torch.arange(self.n_keep, self.n_keep + self.ring_size)
            kept = window[self.slot_positions[window] >= 0]
            oldest = kept[self.slot_positions[kept].argsort()][: self.n_discard]
            self.slot_positions[oldest] = -1  # dropped for good
            kept = window[self.slot_positions[window] >= 0]
            self.slot_positions[kept] -= self.n_discard
            if self.explicit_ropes is not None:  # each layer by its own rotary table
                for keys, rope in zip(self.layer_keys, self.explicit_ropes):
                    keys[:, :, kept] = rope.rotate_by(keys[:, :, kept], torch.tensor(-self.n_discard))
            self.total_shift = getattr(self, "total_shift", 0) + self.n_discard
        super().reserve([position - getattr(self, "total_shift", 0)])
        self.query_shift = [0]  # every stored key is already in the query's frame

    def relative_positions(self, query_positions):
        keys = self.slot_positions[: self.used][None, :]
        return (keys - query_positions.reshape(-1)[:, None])[None]


class ExplicitShiftEngine(ShiftEngine):
    """Feeds one token at a time at its position in the shifted frame, into an ExplicitShiftCache."""

    def __init__(self, model, n_ctx, n_keep, n_discard):
        super().__init__(model, n_ctx, n_keep, n_discard)
        cfg = model.config
        self.cache = ExplicitShiftCache(cfg.num_layers, cfg.num_kv_heads, n_ctx, n_keep, n_discard, cfg.head_dim,
                                        model.dtype, model.device, self.cache.layer_ropes)

    def feed_chunks(self, tokens, all_logits):
        cache = self.cache
        for token in tokens:
            cache.reserve([self.next_position])
            position = torch.tensor([self.next_position - getattr(cache, "total_shift", 0)])
            mask = cache.mask(position, self.model.dtype)
            yield self.model.forward(token.view(1, 1), position[None], cache, mask, all_logits)[0]
            self.next_position += 1


def logit_trace(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Feed tokens one at a time; logits after each [N, V]."""
    with torch.inference_mode():
        return torch.stack([engine.feed(tokens[i : i + 1]) for i in range(tokens.shape[0])])
