"""The cross-attention cache of an encoder-decoder model: the encoder output's K/V, per decoder layer.

The source does not change while the target is generated, so the K and V a decoder layer's
cross-attention reads are constants (the seed's "cache everything that doesn't depend on q"). They
are projected once, before the first decoder step, and every step only projects its query.
One K and one V ``[B, H, S_src, D]`` per decoder layer, plus the additive source-padding mask
``bias`` ``[B, 1, 1, S_src]`` (None when no source row is padded), which every step reuses too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..layers.attention import attention


class CrossAttentionCache:
    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], bias: torch.Tensor | None):
        self.keys = keys  # per layer [B, H, S_src, D]
        self.values = values  # per layer [B, H, S_src, D]
        self.bias = bias  # [B, 1, 1, S_src] or None

    @classmethod
    def build(
        cls,
        project: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        num_layers: int,
        memory: torch.Tensor,
        valid: torch.Tensor,
    ) -> "CrossAttentionCache":
        """Project the encoder output ``memory`` [B, S_src, C] once per layer with ``project(layer, memory)``.

        K/V are made contiguous here, once: a strided view would be copied by every step's attention.
        ``valid`` [B, S_src] marks real source tokens (False: padding, masked out).
        """
        keys, values = [], []
        for layer in range(num_layers):
            k, v = project(layer, memory)
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return cls(keys, values, padding_bias(valid, memory.dtype))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[index], self.values[index]

    def attend(self, index: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """Cross-attention of decoder layer ``index``: q [B, H, T, D] -> [B, H, T, D]."""
        k, v = self.layer(index)  # [B, H, S_src, D], projected once per source
        return attention(q, k, v, self.bias, scale)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the batch (finished sequences, or settled beam samples, dropped)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        if self.bias is not None:
            self.bias = self.bias.index_select(0, rows)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def padding_bias(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """valid [B, S] -> additive key mask [B, 1, 1, S] (0 or -inf), or None when nothing is padded.

    Every row keeps at least one real token, so no attention row is all -inf (no NaN).
    """
    if bool(valid.all()):
        return None
    bias = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    bias.masked_fill_(~valid, float("-inf"))
    return bias[:, None, None, :]  # [B, 1, 1, S]


class BeamCrossAttention:
    """Beam search over a CrossAttentionCache of B sources: the K/V stay once per source and the
    K beams of a sample are folded into the query axis, [B, H, K*T, D] x [B, H, S_src, D], so each
    source K/V is read once per step for all beams (FastSeq), never repeated or reordered."""

    def __init__(self, cross: CrossAttentionCache, num_beams: int):
        self.cross = cross
        self.num_beams = num_beams

    def attend(self, index: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B*K, H, T, D] -> [B*K, H, T, D]."""
        N, H, T, D = q.shape
        K = self.num_beams
        folded = q.view(N // K, K, H, T, D).transpose(1, 2).reshape(N // K, H, K * T, D)  # [B, H, K*T, D]
        out = self.cross.attend(index, folded, scale)  # [B, H, K*T, D]; the padding bias [B, 1, 1, S] broadcasts
        return out.view(N // K, H, K, T, D).transpose(1, 2).reshape(N, H, T, D)  # [B*K, H, T, D]

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Drop settled samples' source K/V."""
        self.cross.select_rows(samples)

    @property
    def nbytes(self) -> int:
        return self.cross.nbytes
