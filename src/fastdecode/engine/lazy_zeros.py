"""Zero tensors whose memory costs nothing until it is used (the slot cache's K/V buffers)."""

from __future__ import annotations

import math

import numpy as np
import torch

CPU_ALIGNMENT = 64  # bytes: torch's own CPU allocations are aligned so (vector loads in the kernels)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU from calloc'd memory (numpy's zeros), whose pages the OS maps
    zeroed when first touched: a cache sized for a long-lived engine (1 GiB by default) then costs
    nothing until its blocks are used, where ``torch.zeros`` writes every byte at once (0.5 s of
    CPU for the default cache of SmolLM2-135M)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + CPU_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % CPU_ALIGNMENT
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)
