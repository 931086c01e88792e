"""The one attention entry point every family uses, and the mask builder.

Grouped-query and multi-query attention never repeat K/V (DESIGN.md section 2): ``attention``
runs our kernel for float32 on the CPU (layers/prompt_attention.cpp: the query heads of a group folded into
the query axis, each K/V block read once for them), else SDPA's native grouped heads (each KV head read once
for its group), and the two-segment attention folds the query heads of a group into the query-time axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from . import ops
from .threads import KERNEL_PARALLEL_MIN_WORK, pool_threads_for, threads_for


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2): cap * tanh(scores / cap), before the mask; None: as is."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
    softcap: float | None = None, *, threads: int,
) -> torch.Tensor:
    """Scaled dot-product attention with K/V heads shared by groups of query heads.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D] with H a multiple of Hkv;
    mask: additive [B, 1, T, S] (0 or -inf) or None (every key visible). Without grouping
    (H == Hkv) it may be any bias broadcastable to [B, H, T, S] (ALiBi, T5's relative bias).
    ``softcap``: scores soft-capped before the mask (``soft_cap``; SDPA has no such step, so the
    scores are then formed explicitly, query heads of a group folded as ``two_segment_attention``).
    ``threads``: the forward's thread budget (``Products.threads``). Returns [B, H, T, D].
    """
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    if mask is not None and mask.shape[1] != 1 and H != Hkv:
        raise ValueError("a per-head attention bias needs one KV head per query head")
    if softcap is not None:
        folded, folded_mask = _fold_groups(q, mask, Hkv)  # [B, Hkv, G*T, D], [B, 1|H, G*T, S]
        scores = soft_cap(folded @ k.transpose(-1, -2) * scale, softcap)  # [B, Hkv, G*T, S]
        if folded_mask is not None:
            scores = scores + folded_mask
        out = scores.float().softmax(dim=-1).to(v.dtype) @ v  # [B, Hkv, G*T, D]
        return out.reshape(B, H, T, D)  # [B, Hkv, G*T, D] -> [B, H, T, D]
    if q.is_cuda and T == 1 and H != Hkv and (mask is None or mask.shape[1] == 1):
        # one query per row (a decode step): the group's query heads become the query axis of their
        # KV head, so the GPU's fused kernels (which lack native GQA) read each K/V head once
        q = q.reshape(B, Hkv, H // Hkv, D)  # [B, H, 1, D] -> [B, Hkv, G, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # mask [B, 1, 1, S] broadcasts
        return out.reshape(B, H, 1, D)  # [B, Hkv, G, D] -> [B, H, 1, D]
    if _kernel_runs(q, k, v, mask):  # float32 on the CPU: our kernel (layers/prompt_attention.cpp)
        if mask is not None:
            mask = mask.expand(B, mask.shape[1], T, k.shape[2])  # [B, 1|H, T, S] (broadcast dims: stride 0)
        work = q.numel() * k.shape[2]  # B*H*T*D * S multiply-adds, twice
        return ops.prompt_attention(q, k, v, mask, scale, threads if work >= KERNEL_PARALLEL_MIN_WORK else 1)
    if mask is not None and T > QUERY_CHUNK and not q.is_cuda and not torch.compiler.is_compiling():
        extents = _key_extents(mask)
        if extents is not None:  # a prompt's queries in chunks, each over the keys it can see (rounded up)
            return torch.cat([_sdpa(q[:, :, start:start + QUERY_CHUNK], k[:, :, :keys], v[:, :, :keys],
                                    mask[:, :, start:start + QUERY_CHUNK, :keys], scale, threads)
                              for start, keys in zip(range(0, T, QUERY_CHUNK), extents)], dim=2)  # [B, H, T, D]
    return _sdpa(q, k, v, mask, scale, threads)


def _kernel_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether our attention kernel (layers/prompt_attention.cpp) serves these operands: float32 on the CPU, rows
    contiguous in their last dim, a float32 mask (or none) of one or H heads and S keys contiguous, outside
    torch.compile, the extension built."""
    return (q.dtype == torch.float32 and k.dtype == torch.float32 and v.dtype == torch.float32
            and q.device.type == "cpu"
            and (mask is None or (mask.dtype == torch.float32 and mask.dim() == 4 and mask.shape[1] in (1, q.shape[1])
                                  and mask.shape[-1] == k.shape[2] and mask.stride(-1) == 1))
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and not torch.compiler.is_compiling() and ops.available())


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
          threads: int) -> torch.Tensor:
    with threads_for(q.numel() * k.shape[2], threads):  # B*H*T*D * S multiply-adds
        # SDPA's native GQA: each KV head serves its group of query heads as it is (PyTorch's CPU
        # flash kernel indexes head h // G; no K/V copy), one op with no per-layer mask folding.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# On SDPA's path (other dtypes on the CPU; float32 runs our kernel, which skips hidden keys exactly) a prompt's
# causal mask hides the keys after each query: SDPA (with a mask, not ``is_causal``) scores them all, twice the
# work a 512-token prompt needs. Its queries in chunks of QUERY_CHUNK rows, each over the keys up to the last one
# its mask shows rounded up to KEY_MULTIPLE, skip most of it (a 512-token prompt: 3/4 of the work, 2048 tokens:
# 9/16). Rounded up to 256 keys, PyTorch's CPU flash kernel gave float32 the same bits as over all the keys on the
# Intel Xeon of the benchmarks; on AMD EPYC Zen 5, where MKL's GEMMs round a block of 256 keys differently from
# one of 512, up to 3e-7 apart.
QUERY_CHUNK = 256
KEY_MULTIPLE = 256
_extents: WeakIdKeyDictionary = WeakIdKeyDictionary()  # mask -> its chunks' key counts (or None): a forward's
# layers share one mask, read once


def _key_extents(mask: torch.Tensor) -> list[int] | None:
    """For an additive mask [B, 1 or H, T, S]: the key count each QUERY_CHUNK of queries needs (the last key
    any of them sees, plus one, rounded up to KEY_MULTIPLE, at most S), or None when every chunk needs them all."""
    if mask in _extents:
        return _extents[mask]
    T, S = mask.shape[-2:]
    seen = (mask != float("-inf")).any(dim=0).any(dim=0)  # [T, S]: keys some batch row / head sees
    last = torch.where(seen, torch.arange(1, S + 1, device=mask.device), 0).amax(dim=-1)  # [T]: last seen key + 1
    chunk_last = torch.nn.functional.pad(last, (0, -T % QUERY_CHUNK)).view(-1, QUERY_CHUNK).amax(dim=-1)  # [chunks]
    extents = [min(S, -(-int(n) // KEY_MULTIPLE) * KEY_MULTIPLE) for n in chunk_last.tolist()]
    result = None if all(n == S for n in extents) else extents
    _extents[mask] = result
    return result


def paged_attention_runs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the C++ decode attention over a block pool (layers/attention.cpp) serves these tensors
    (float32 on the CPU, the extension built); else the caller gathers and runs SDPA."""
    return q.dtype == torch.float32 and keys.dtype == torch.float32 and q.device.type == "cpu" and ops.available()


def paged_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                    key_start: torch.Tensor, positions: torch.Tensor, block_size: int, window: int | None,
                    scale: float, bias: torch.Tensor | None = None,
                    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, *,
                    threads: int) -> torch.Tensor:
    """One query per row over the row's blocks, read in place: q [B, H, D] (D contiguous); a layer's
    keys, values [slots, Hkv, D]; table [B, n] block ids whose key i sits at position key_start + i
    (key_start [B]); positions [B] of the queries (a row sees its keys up to its own position, and
    fewer than ``window`` back); bias [B, 1 or H, n * block] added to the scores (ALiBi, T5) or None.
    ``write`` (k_new, v_new [B, Hkv, D], slots [B]): stored first, in the same op -> [B, H, D].
    ``threads``: the forward's thread budget."""
    k_new, v_new, slots = write if write is not None else (None, None, None)
    q, k_new, v_new = (t if t is None or t.stride(-1) == 1 else t.contiguous() for t in (q, k_new, v_new))
    # the op splits its (row, KV head) items over the kernel pool on torch's thread count: one thread for
    # small steps; inside torch.compile pool_threads_for compares nothing, so the dynamic block count gets no guard
    with pool_threads_for(2 * q.numel() * table.shape[1] * block_size, threads):  # B*H*D * S multiply-adds, twice
        return ops.paged_attention(q, keys, values, k_new, v_new, slots, table, key_start, positions, block_size,
                                   window or 0, scale, bias)


def two_segment_attention(
    q_first: torch.Tensor, k_first: torch.Tensor, v_first: torch.Tensor,
    q_rest: torch.Tensor, k_rest: torch.Tensor, v_rest: torch.Tensor,
    mask: torch.Tensor | None, scale: float, softcap: float | None = None,
) -> torch.Tensor:
    """Attention over two key segments, each scored with its own version of the queries, under
    one softmax over both.

    Used when two segments of a cache sit in different position frames: a streaming cache's
    attention sinks keep their positions while the window has been shifted, so the queries are
    rotated once per segment instead of rewriting cached keys.
    q_*: [B, H, T, D]; k_*, v_*: [B, Hkv, S_*, D]; mask additive [B, 1, T, S_first + S_rest] or None
    ``softcap``: as ``attention``'s. -> [B, H, T, D].
    """
    B, H, T, D = q_first.shape
    Hkv = k_first.shape[1]
    q_first, mask = _fold_groups(q_first, mask, Hkv)  # [B, Hkv, G*T, D]
    q_rest, _ = _fold_groups(q_rest, None, Hkv)  # [B, Hkv, G*T, D]
    scores = torch.cat((q_first @ k_first.transpose(-1, -2), q_rest @ k_rest.transpose(-1, -2)), dim=-1) * scale
    scores = soft_cap(scores, softcap)
    if mask is not None:  # scores: [B, Hkv, G*T, S_first + S_rest]
        scores = scores + mask
    probs = scores.float().softmax(dim=-1).to(v_first.dtype)
    split = k_first.shape[2]
    out = probs[..., :split] @ v_first + probs[..., split:] @ v_rest  # [B, Hkv, G*T, D]
    return out.reshape(B, H, T, D)  # [B, Hkv, G*T, D] -> [B, H, T, D]


def split_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Projected [B, T, H*D] -> per-head [B, H, T, D] (a view)."""
    B, T, _ = x.shape
    return x.view(B, T, num_heads, head_dim).transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """Attention output [B, H, T, D] -> [B, T, H*D] for the output projection."""
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H, D] -> [B, T, H*D]


def _fold_groups(q: torch.Tensor, mask: torch.Tensor | None, num_kv_heads: int):
    """Fold the query heads sharing a KV head into the query-time axis (no K/V repeat).

    Query head h = kv_head * G + g (as HF's repeat_kv): q [B, H, T, D] -> [B, Hkv, G*T, D];
    a mask [B, 1, T, S] is repeated along the folded axis -> [B, 1, G*T, S].
    """
    B, H, T, D = q.shape
    group = H // num_kv_heads
    if group == 1:
        return q, mask
    q = q.reshape(B, num_kv_heads, group * T, D)  # [B, Hkv, G*T, D]
    if mask is not None:
        if mask.shape[1] != 1:
            raise ValueError("a per-head attention bias needs one KV head per query head")
        S = mask.shape[-1]
        mask = mask[:, :, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)  # [B, 1, G*T, S]
    return q, mask


def build_attention_mask(
    key_valid: torch.Tensor,
    query_start: int,
    num_queries: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive causal + padding mask [B, 1, T, S] for queries in slots query_start .. query_start+T-1.

    key_valid [B, S]: False for padding slots. A query sees keys in earlier or equal slots that are
    valid (sliding layers add their window by position: ``position_mask``). Each query always sees its
    own slot, so a padding query never has an empty row (no NaN); its output is never used.
    """
    S = key_valid.shape[1]
    device = key_valid.device
    key_slots = torch.arange(S, device=device)
    query_slots = torch.arange(query_start, query_start + num_queries, device=device)
    causal = key_slots[None, :] <= query_slots[:, None]  # [T, S]
    allowed = causal[None] & key_valid[:, None, :]  # [B, T, S]
    allowed |= (key_slots[None, :] == query_slots[:, None])[None]  # own slot
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[:, None]  # [B, 1, T, S]


def position_mask(distance: torch.Tensor, window: int | None, score_bias, dtype: torch.dtype) -> torch.Tensor:
    """Key minus query position [B, T, S] (key j of a sequence sits at position j) -> additive
    mask [B, 1, T, S] (or [B, H, T, S] with a position bias): a query sees keys at its position or
    before, and on a sliding-window layer fewer than ``window`` positions back."""
    allowed = distance <= 0
    if window is not None:
        allowed &= distance > -window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask = mask.masked_fill(~allowed, float("-inf"))[:, None]  # [B, 1, T, S]
    return mask if score_bias is None else score_bias(distance) + mask
