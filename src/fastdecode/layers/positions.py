"""Rotary position embeddings (RoPE): frequencies for the common scaling types, and rotation.

Angles are computed in float64 from integer positions and cast afterwards: positions grow
without bound in long streams and float32 products drift (DESIGN.md section 2).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ONE_POSITION_TABLES = 4096  # single positions whose rotation tables a RotaryEmbedding keeps (about 1 KB each)


def rope_type(scaling: dict[str, Any] | None) -> str:
    """The scaling type of a ``rope_scaling`` / ``rope_parameters`` dict, refused by name when unknown
    (checked when the config is read, before any weight)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return kind


def rope_inverse_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Return (inv_freq [rotary_dim // 2] float64, attention_factor) for a RoPE config.

    ``attention_factor`` scales cos and sin (YaRN's "mscale"); 1.0 for the other types.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type(scaling)
    if kind == "default":
        return inv_freq, 1.0
    if kind in ("longrope", "su"):
        return _longrope_inv_freq(inv_freq, scaling, max_position_embeddings)
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, factor, scaling), 1.0
    return _yarn_inv_freq(rotary_dim, theta, factor, scaling, max_position_embeddings)


def _llama3_inv_freq(inv_freq: torch.Tensor, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def longrope_switches(scaling: dict[str, Any] | None) -> bool:
    """Whether a LongRoPE config has distinct short and long factors (transformers then picks the
    set by the sequence's length, and recomputes a cache that crosses the switch)."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if rope_type not in ("longrope", "su"):
        return False
    missing = [key for key in ("short_factor", "long_factor", "original_max_position_embeddings") if key not in scaling]
    if missing:
        raise UnsupportedModelError(f"{rope_type!r} rope scaling needs {', '.join(missing)}")
    return list(scaling["short_factor"]) != list(scaling["long_factor"])


def _longrope_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position_embeddings: int
                       ) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 "su"/"longrope"): each frequency divided by its own factor, and cos, sin
    scaled by ``attention_factor`` (default sqrt(1 + ln(factor) / ln(original)), factor the
    context growth). transformers uses ``short_factor`` for sequences of at most
    ``original_max_position_embeddings`` tokens and ``long_factor`` past that, rebuilding the
    whole cache at the switch; one table cannot do both, so a context that reaches past the switch
    with distinct factors is refused here (Phi-3's loader caps the context at the switch instead)."""
    switches = longrope_switches(scaling)  # first: it names any missing key
    original = int(scaling["original_max_position_embeddings"])
    if switches and max_position_embeddings > original:
        raise UnsupportedModelError(
            f"LongRoPE with distinct short and long factors runs only up to original_max_position_embeddings "
            f"({original}); this context is {max_position_embeddings}")
    factors = scaling["short_factor"] if max_position_embeddings <= original else scaling["long_factor"]
    factors = torch.tensor([float(f) for f in factors], dtype=torch.float64)
    if factors.shape != inv_freq.shape:
        raise UnsupportedModelError(f"LongRoPE needs {inv_freq.shape[0]} factors (half the rotary dims), "
                                    f"got {factors.shape[0]}")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:  # the context growth; transformers' default: max positions / original
        factor = float(scaling.get("factor") or max_position_embeddings / original)
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / factors, float(attention_factor)


def _yarn_inv_freq(
    dim: int, theta: float, factor: float, scaling: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding:
    """cos/sin for arbitrary integer positions, half-split ("NeoX", HF) layout."""

    def __init__(self, rotary_dim: int, inv_freq: torch.Tensor, attention_factor: float = 1.0):
        self.rotary_dim = rotary_dim
        self.inv_freq = inv_freq.to(torch.float64)
        self.attention_factor = attention_factor
        # inv_freq on each device it was used on: a forward on a GPU copies nothing from the host (a
        # captured CUDA graph cannot), the first (warm-up) call copies it once
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        # (position, dtype) -> ``tables`` of that one CPU position, as computed for it: a batch-1 decode step
        # looks its tables up instead of running seven small ops (at most ONE_POSITION_TABLES kept)
        self._one_position: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, scaled: bool = True
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (int) -> cos, sin [B, 1, T, rotary_dim] ready to broadcast over heads.

        ``scaled=False`` leaves out YaRN's attention factor: a pure rotation, for re-rotating
        vectors that were already scaled once.
        """
        cos, sin = self._half_cos_sin(positions, scaled)  # [B, T, rotary_dim/2]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)  # [B, T, rotary_dim]
        return cos[:, None].to(dtype), sin[:, None].to(dtype)  # [B, 1, T, rotary_dim]

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> (cos, signed sin) [B, T, 1, rotary_dim] for ``rotate_heads`` on heads laid
        out [B, T, H, D] (a projection's output before its transpose). The sine's first half is
        negated once here instead of negating half of every rotated vector; otherwise the values of
        ``cos_sin``. A single CPU position's tables are kept (the same tensors, never written to)."""
        if positions.shape != (1, 1) or positions.device.type != "cpu" or torch.compiler.is_compiling():
            return self._tables(positions, dtype)
        key = (int(positions.item()), dtype)
        kept = self._one_position.get(key)
        if kept is None:
            kept = self._tables(positions, dtype)
            if len(self._one_position) < ONE_POSITION_TABLES:
                self._one_position[key] = kept
        return kept

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``tables``, computed."""
        cos, sin = self._half_cos_sin(positions)  # [B, T, rot/2]
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # [B, T, rot]
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # [B, T, rot]
        return cos[:, :, None], signed_sin[:, :, None]  # [B, T, 1, rot]

    def _half_cos_sin(self, positions: torch.Tensor, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> float64 cos, sin [B, T, rotary_dim/2] of each frequency's angle, times
        YaRN's attention factor when ``scaled`` (one rounding to the dtype comes after)."""
        angles = positions.to(torch.float64)[..., None] * self._inv_freq(positions.device)  # [B, T, rot/2]
        cos, sin = angles.cos(), angles.sin()
        if scaled and self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos, sin

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.inv_freq
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        return self._inv_freq_on[device]

    def rotate_by(self, x: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        """Rotate already-rotated vectors x [B, H, T, D] by ``delta`` more positions (an int, or
        one delta per query [T]).

        Rotations compose: R(a) R(b) = R(a + b), so a vector rotated at position p becomes the
        one rotated at p + delta, without knowing p. Used to move keys or queries in a stream.
        """
        deltas = torch.as_tensor(delta, device=x.device).reshape(1, -1)  # [1, T or 1]
        cos, sin = self.cos_sin(deltas, x.dtype, scaled=False)
        return rotate_half_split(x, cos, sin)


class NoRotation:
    """A layer without positions (NoPE, SmolLM3): the rotation tables of the identity (cos 1, sin 0:
    ``x * 1 + swapped * 0`` is x exactly) and shifts that move nothing, so the layer runs through
    the same code as its rotating neighbours, streaming shifts included."""

    def __init__(self, rotary_dim: int):
        self.rotary_dim = rotary_dim

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos 1, sin 0 [B, T, 1, rotary_dim]."""
        B, T = positions.shape
        ones = torch.ones(B, T, 1, self.rotary_dim, dtype=dtype, device=positions.device)
        return ones, torch.zeros_like(ones)

    def rotate_by(self, x: torch.Tensor, delta: int | torch.Tensor) -> torch.Tensor:
        return x


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` dims of x [B, H, T, D] in the half-split layout.

    Pairs are (i, i + rot/2). Dims past ``rot`` (partial rotary) pass through unchanged.
    """
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((rotated, x_pass), dim=-1)


def rotate_heads(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``rotate_half_split`` with the tables of ``RotaryEmbedding.tables``: x [B, T, H, D], any
    number of heads (queries and keys at once). Bit-identical to it: x2 * -sin is -x2 * sin, and
    swapping the halves with one ``flip`` replaces the negation and the concatenation."""
    rot = cos.shape[-1]
    if rot != x.shape[-1]:  # partial rotary: dims past rot pass through
        return torch.cat((rotate_heads(x[..., :rot], cos, signed_sin), x[..., rot:]), dim=-1)
    swapped = x.unflatten(-1, (2, rot // 2)).flip(-2).flatten(-2)  # [..., D]: (x2, x1)
    return x * cos + swapped * signed_sin


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.; as BLOOM): a geometric sequence starting at 2^(-8/n)
    for the closest power of two n <= heads, interleaved extras for the remaining heads. [H]"""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        extra = min(closest, num_heads - closest)
        slopes += [extra_base ** (2 * i + 1) for i in range(extra)]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_relative_buckets(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each relative position (key position - query position), int64, same shape.

    Half of the buckets hold exact small distances, the other half logarithmically wider bins up
    to ``max_distance``; bidirectional (encoder) buckets split again by the sign. The float32 log
    is the one transformers / Mesh TensorFlow use, so bucket edges are identical.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).to(torch.long) * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)  # only keys at or before the query
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    scaled = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    large = torch.clamp(max_exact + scaled.to(torch.long), max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


def sinusoidal_table(num_positions: int, dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Marian's fixed position table [P, dim]: sines in the first half, cosines in the second.

    Column j uses the frequency of pair j // 2 (XLM's formula, not interleaved); built in float64
    and cast, as transformers does, so the table equals the one it computes.
    """
    positions = torch.arange(num_positions, dtype=torch.float64)[:, None]  # [P, 1]
    exponents = 2 * (torch.arange(dim) // 2).to(torch.float64) / dim  # [dim]
    angles = positions / torch.pow(torch.tensor(10000.0, dtype=torch.float64), exponents)  # [P, dim]
    half = (dim + 1) // 2
    table = torch.empty(num_positions, dim, dtype=torch.float64)
    table[:, :half] = torch.sin(angles[:, 0::2])
    table[:, half:] = torch.cos(angles[:, 1::2])
    return table.to(dtype=dtype, device=device)
