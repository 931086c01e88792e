"""One engine for one call of the Python API ("submit everything, step until done").

``submit_call`` sizes an engine for a call's requests (every sequence at once when the default
cache budget allows, whole blocks each, and at least the longest one) and submits them all; the
caller steps it until it has no work.
"""

from __future__ import annotations

from typing import Any

from .beam_group import group_blocks
from .requests import Request, RequestFactory
from .core import DEFAULT_CACHE_BYTES, Engine
from .sequence import Sequence
from .slots import BLOCK_SIZE
from .streaming_policy import stream_capacity


def slots_for(lengths: list[int], bytes_per_token: int) -> int:
    """Cache slots for an engine that runs sequences of these lengths at once when the default
    cache budget allows (whole blocks each), and at least the longest one."""
    blocks = [-(-n // BLOCK_SIZE) * BLOCK_SIZE for n in lengths]
    return max(max(blocks), min(sum(blocks), DEFAULT_CACHE_BYTES // bytes_per_token))


def _needed(context: int, config: Any) -> int:
    """Cache slots one request may hold: a stream its n_ctx plus headroom, a beam group its shared
    prompt and every beam's tokens, anything else its context and new tokens."""
    if config.n_ctx is not None:
        return stream_capacity(config)
    if config.num_beams > 1:
        return group_blocks(context, config.max_new_tokens, config.num_beams, BLOCK_SIZE) * BLOCK_SIZE
    return context + config.max_new_tokens


def submit_call(model: Any, factory: RequestFactory, requests: list[Request]) -> tuple[Engine, list[Sequence]]:
    """An engine sized for ``requests`` (one call's, ``RequestFactory.build_call``), each submitted,
    in order."""
    config, itemsize = model.config, model.dtype.itemsize
    source_tokens = None
    if config.is_encoder_decoder:  # the decoder runs its start token, the sources go to the encoder
        source_tokens = slots_for([len(r.prompt) for r in requests], config.cross_cache_bytes_per_source_token(itemsize))
        contexts = [1] * len(requests)
    else:
        contexts = [len(r.prompt) for r in requests]
    needed = [_needed(n, r.config) for n, r in zip(contexts, requests)]
    cache_tokens = slots_for(needed, config.kv_cache_bytes_per_token(itemsize))
    engine = Engine(model, factory, max_queue=len(requests), cache_tokens=cache_tokens, source_tokens=source_tokens)
    return engine, [engine.add(request) for request in requests]


__all__ = ["slots_for", "submit_call"]
