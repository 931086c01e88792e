"""A test harness: one stream alone (batch of one) on a slot cache of its own, driven token by
token or chunk by chunk, every position's logits kept.

The policy (sinks + shift / re-evaluate) and the cache view are the engine's own
(engine/streaming_policy.py, engine/stream_plan.py): the engine runs streams beside every other
sequence (engine/stream_steps.py), and the tests compare those with this harness, and this harness
with the explicit definitions (streaming_reference.py), reaching into the policy's state.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fastdecode.config import GenerationConfig
from fastdecode.engine.slots import BLOCK_SIZE, SlotCache
from fastdecode.engine.stream_plan import StreamPlan
from fastdecode.layers.products import Products
from fastdecode.engine.streaming_policy import MAX_CHUNK, StreamingPolicy, check_streamable

__all__ = ["StreamAlone", "stream_alone"]


class StreamAlone:
    """One stream under ``policy`` "shift" or "reevaluate" in a cache sized for it."""

    def __init__(self, model, n_ctx: int, n_keep: int, n_discard: int, policy: str = "shift",
                 headroom: int | None = None):
        cfg = model.config
        check_streamable(cfg, n_ctx, policy)
        self.model = model
        capacity = n_ctx + ((headroom or min(n_ctx, MAX_CHUNK)) if policy == "shift" else 0)
        cache = SlotCache(cfg.num_layers, -(-capacity // BLOCK_SIZE), cfg.num_kv_heads, cfg.head_dim,
                          model.dtype, model.device, BLOCK_SIZE)
        self.policy = StreamingPolicy(model, cache, n_ctx, n_keep, n_discard, policy, headroom)
        self.policy.admit()

    def __getattr__(self, name: str):  # the policy's state and verbs (cache, end, sinks, _move_sinks, ...)
        return getattr(self.__dict__["policy"], name)

    @property
    def table(self) -> list[int]:
        return self.policy.table

    @table.setter
    def table(self, table: list[int]) -> None:
        self.policy.table = table

    def _plan(self, count: int, prompt: bool = False) -> StreamPlan:
        return self.policy.plan(count).with_products(self._products(prompt))

    def _products(self, prompt: bool) -> Products:
        """The rows' roles (``prompt``: exact products; else the generated rows' kernels, as this
        scorer's stream has always run) and the caller's threads."""
        return Products.of_rows(prompt, torch.get_num_threads(), self.model.device, kernels=self.model.kernels)

    def feed(self, tokens: torch.Tensor, prompt: bool = False) -> torch.Tensor:
        """Feed tokens [N]; logits of the last one [V]."""
        logits = None
        for logits in self.feed_chunks(tokens, all_logits=False, prompt=prompt):
            pass
        return logits[-1]

    def feed_chunks(self, tokens: torch.Tensor, all_logits: bool, prompt: bool = False) -> Iterator[torch.Tensor]:
        """Feed tokens [N] through the policy; yield logits per chunk ([T, V], or [1, V] for the
        chunk's last token when not ``all_logits``); ``prompt``: the rows' role (``_products``)."""
        done, policy, products = 0, self.policy, self._products(prompt)
        while done < tokens.shape[0]:
            size = policy.chunk_size(tokens.shape[0] - done)
            chunk = tokens[done : done + size].tolist()
            plan = policy.begin(chunk, lambda piece, rebuild: self._forward(piece, rebuild.with_products(products),
                                                                             False))
            logits = self._forward(chunk, plan.with_products(products), all_logits)
            policy.finish(size)
            done += size
            yield logits

    def _forward(self, chunk: list[int], plan: StreamPlan, all_logits: bool) -> torch.Tensor:
        tokens = torch.tensor([chunk], device=self.model.device)  # [1, T]
        return self.model.forward(tokens, plan.positions[None], plan, all_logits)[0]


def stream_alone(model, config: GenerationConfig) -> StreamAlone:
    """The stream for a config with ``n_ctx`` set."""
    return StreamAlone(model, config.n_ctx, config.n_keep, config.discard_count, config.policy)
