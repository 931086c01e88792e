"""The streaming shift policy by its definition, for tests: a plain static cache of n_ctx slots,
where slot i holds the token at position i. When a token arrives to a full cache, the n_discard
oldest window tokens are dropped, every kept window key is rewritten rotated by -n_discard (each
layer with its own RoPE table) and moved n_discard slots down at once, and the token enters at
its position in the shifted frame; attention is the model's own over the static cache (no slot
cache, no plan, no sink frames), so it shares nothing with engine/streaming_policy.py."""

from __future__ import annotations

import torch

from fastdecode.layers.attention import attention, position_mask
from fastdecode.layers.products import Products


class StaticSlots:
    """One sequence's K/V in preallocated per-layer buffers [1, Hkv, S, D], slot i at position i
    (the view a model's forward attends through, cache/view.py): causal by position, each layer's
    window and the model's ALiBi bias from ``position_mask``, as every view masks."""

    def __init__(self, model, num_layers, num_kv_heads, capacity, head_dim, dtype, device):
        cfg = model.config
        self.layer_windows = cfg.layer_windows
        self.score_bias = model.alibi_bias if cfg.position_kind == "alibi" else None
        shape = (1, num_kv_heads, capacity, head_dim)
        self.layer_keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.layer_values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.positions = torch.zeros(1, capacity, dtype=torch.long, device=device)  # [1, S]
        self.length = 0  # slots in use
        self.write_start = 0
        self.products = None

    def append_slots(self, positions, products):
        """Reserve the next T slots for tokens at ``positions`` [1, T], run with ``products``."""
        self.write_start, count = self.length, positions.shape[1]
        self.positions[:, self.length : self.length + count] = positions
        self.length += count
        self.products = products

    def attend(self, layer, q, k, v, scale, softcap=None):
        start, end = self.write_start, self.length
        keys, values = self.layer_keys[layer], self.layer_values[layer]
        keys[:, :, start:end], values[:, :, start:end] = k, v
        distance = self.positions[:, None, :end] - self.positions[:, start:end, None]  # [1, T, S] key - query
        mask = position_mask(distance, self.layer_windows[layer], self.score_bias, q.dtype)
        return attention(q, keys[:, :, :end], values[:, :, :end], mask, scale, softcap, threads=self.products.threads)


class ExplicitShiftEngine:
    def __init__(self, model, n_ctx, n_keep, n_discard):
        cfg = model.config
        self.model, self.n_ctx, self.n_keep, self.n_discard = model, n_ctx, n_keep, n_discard
        self.cache = StaticSlots(model, cfg.num_layers, cfg.num_kv_heads, n_ctx, cfg.head_dim, model.dtype, model.device)
        self.ropes = model.layer_ropes if cfg.position_kind == "rope" else None

    def _shift(self):
        cache, n, first, d = self.cache, self.cache.length, self.n_keep + self.n_discard, self.n_discard
        for layer, (keys, values) in enumerate(zip(cache.layer_keys, cache.layer_values)):
            kept = keys[:, :, first:n].clone()  # [1, Hkv, n - first, D]
            if self.ropes is not None:
                kept = self.ropes[layer].rotate_by(kept, torch.tensor(-d))
            keys[:, :, self.n_keep : n - d] = kept
            values[:, :, self.n_keep : n - d] = values[:, :, first:n].clone()
        cache.length = n - d  # slot i still holds position i

    def feed(self, tokens, prompt: bool = False):
        logits = None
        for token in tokens:
            if self.cache.length == self.n_ctx:
                self._shift()
            position = self.cache.length
            positions = torch.tensor([[position]], device=self.model.device)
            self.cache.append_slots(positions, Products.of_rows(prompt, torch.get_num_threads(),
                                                                 kernels=self.model.kernels))
            logits = self.model.forward(token.view(1, 1).to(self.model.device), positions, self.cache)[0, -1]
        return logits


def logit_trace(engine, tokens: torch.Tensor) -> torch.Tensor:
    """Feed tokens one at a time; logits after each [N, V]."""
    with torch.inference_mode():
        return torch.stack([engine.feed(tokens[i : i + 1], prompt=False) for i in range(tokens.shape[0])])
