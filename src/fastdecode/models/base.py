"""What every family's model class shares: where its weights live."""

from __future__ import annotations

from typing import Any

import torch


def token_id_list(value: Any) -> list[int]:
    """A config's token id field (None, one id or a list of ids) as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [int(value)]


class ModelBase:
    """A model holds its weights as plain tensors; ``embed`` is the token embedding table."""

    embed: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device
