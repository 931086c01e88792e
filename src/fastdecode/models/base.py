"""What every family's model class shares: where its weights live."""

from __future__ import annotations

import torch


class ModelBase:
    """A model holds its weights as plain tensors; ``embed`` is the token embedding table."""

    embed: torch.Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device
