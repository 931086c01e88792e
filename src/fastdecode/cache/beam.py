"""The FastSeq beam-search cache: the prompt's K/V once per sample, only generated K/V per beam.

All beams of a sample share their prompt, so storing its K/V ``beams`` times (and copying it at
every beam reorder) wastes memory and bandwidth. Here the prompt segment is ``[B, Hkv, S_p, D]``
(written once by the prefill) and the generated segment ``[B*K, Hkv, S_g, D]``; a reorder gathers
only the generated segment. Attention is one softmax over both segments: against the shared
prompt keys the K beams of a sample are folded into the query axis, ``[B, Hkv, K*G*T, D] x
[B, Hkv, S_p, D]``, so each prompt key is read once per sample, not once per beam.

It has KVCache's ``attend`` / ``relative_positions`` interface, so decoder-only models run unchanged.
"""

from __future__ import annotations

import torch


class BeamKVCache:
    def __init__(self, prompt_keys: torch.Tensor, prompt_values: torch.Tensor, prompt_valid: torch.Tensor,
                 prompt_positions: torch.Tensor, num_beams: int, capacity: int):
        """prompt_keys/values [L, B, Hkv, S_p, D] (a prefilled KVCache's buffers, kept as they are);
        prompt_valid, prompt_positions [B, S_p]; ``capacity`` generated slots per beam."""
        L, B, Hkv, S_p, D = prompt_keys.shape
        self.num_beams = num_beams
        self.prompt_keys = list(prompt_keys.unbind(0))  # per layer [B, Hkv, S_p, D]
        self.prompt_values = list(prompt_values.unbind(0))
        self.prompt_positions = prompt_positions  # [B, S_p]
        # Additive padding bias over the shared segment, per sample: [B, 1, 1, S_p], or None.
        self.prompt_bias = None
        if not bool(prompt_valid.all()):
            bias = torch.zeros(prompt_valid.shape, dtype=prompt_keys.dtype, device=prompt_keys.device)
            self.prompt_bias = bias.masked_fill_(~prompt_valid, float("-inf"))[:, None, None, :]
        shape = (L, B * num_beams, Hkv, capacity, D)
        self.gen_keys = torch.zeros(shape, dtype=prompt_keys.dtype, device=prompt_keys.device)  # [L, B*K, Hkv, S_g, D]
        self.gen_values = torch.zeros(shape, dtype=prompt_keys.dtype, device=prompt_keys.device)
        self._unbind()
        self.gen_positions = torch.zeros(B, capacity, dtype=torch.long, device=prompt_keys.device)  # [B, S_g]
        self.length = 0  # generated slots in use (the same for every beam)

    def _unbind(self) -> None:
        self.layer_keys = list(self.gen_keys.unbind(0))
        self.layer_values = list(self.gen_values.unbind(0))

    @property
    def batch_size(self) -> int:
        return self.prompt_positions.shape[0]

    def append_slot(self, positions: torch.Tensor) -> None:
        """Reserve the next generated slot for tokens at ``positions`` [B] (one per sample: every
        beam of a sample is at the same position)."""
        if self.length >= self.gen_keys.shape[3]:
            raise RuntimeError(f"beam KV cache overflow: {self.length} + 1 > {self.gen_keys.shape[3]} slots")
        self.gen_positions[:, self.length] = positions
        self.length += 1

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
        """Write k, v [B*K, Hkv, T, D] into the generated segment, attend over prompt + generated.

        q [B*K, H, T, D] -> [B*K, H, T, D]. ``mask``: an extra additive bias over all S_p + S_g keys,
        [B*K, 1|H, T, S] (ALiBi) or None; prompt padding is added here, from the per-sample bias.
        """
        N, H, T, D = q.shape
        K, B = self.num_beams, N // self.num_beams
        Hkv = k.shape[1]
        G = H // Hkv
        end, start = self.length, self.length - T
        gen_k, gen_v = self.layer_keys[layer], self.layer_values[layer]
        gen_k[:, :, start:end] = k
        gen_v[:, :, start:end] = v
        gen_k, gen_v = gen_k[:, :, :end], gen_v[:, :, :end]  # [B*K, Hkv, S_g, D]
        p_k, p_v = self.prompt_keys[layer], self.prompt_values[layer]  # [B, Hkv, S_p, D]
        S_p = p_k.shape[2]

        q_beam = q.reshape(N, Hkv, G * T, D)  # [B*K, H, T, D] -> [B*K, Hkv, G*T, D] (h = kv*G + g)
        q_shared = q_beam.view(B, K, Hkv, G * T, D).transpose(1, 2).reshape(B, Hkv, K * G * T, D)  # beams -> queries
        shared = (q_shared @ p_k.transpose(-1, -2)) * scale  # [B, Hkv, K*G*T, S_p]
        if self.prompt_bias is not None:
            shared = shared + self.prompt_bias  # [B, 1, 1, S_p] broadcast
        shared = shared.view(B, Hkv, K, G * T, S_p).transpose(1, 2).reshape(N, Hkv, G * T, S_p)  # per beam
        own = (q_beam @ gen_k.transpose(-1, -2)) * scale  # [B*K, Hkv, G*T, S_g]
        scores = torch.cat((shared, own), dim=-1)  # [B*K, Hkv, G*T, S_p + S_g]
        if mask is not None:
            scores = scores + _fold_bias(mask, Hkv, G)
        probs = scores.float().softmax(dim=-1).to(q.dtype)
        p_shared = probs[..., :S_p].reshape(B, K, Hkv, G * T, S_p).transpose(1, 2).reshape(B, Hkv, K * G * T, S_p)
        out_shared = (p_shared @ p_v).view(B, Hkv, K, G * T, D).transpose(1, 2).reshape(N, Hkv, G * T, D)
        out = out_shared + probs[..., S_p:] @ gen_v  # [B*K, Hkv, G*T, D]
        return out.reshape(N, H, T, D)  # [B*K, Hkv, G*T, D] -> [B*K, H, T, D]

    def relative_positions(self, query_positions: torch.Tensor) -> torch.Tensor:
        """Key minus query position [B*K, T, S_p + S_g] (ALiBi)."""
        K = self.num_beams
        keys = torch.cat((self.prompt_positions, self.gen_positions[:, : self.length]), dim=1)  # [B, S]
        return keys.repeat_interleave(K, dim=0)[:, None, :] - query_positions[:, :, None]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Beam reorder: rows [B*K] (each a beam of the same sample) -> gather only the generated segment."""
        n = self.length
        if rows.numel() != self.gen_keys.shape[1]:  # settled samples dropped as well: a smaller buffer
            self.gen_keys = self.gen_keys.index_select(1, rows)
            self.gen_values = self.gen_values.index_select(1, rows)
            self._unbind()
            return
        gather_rows_in_place((self.gen_keys, self.gen_values), rows, n)

    def keep_samples(self, samples: torch.Tensor) -> None:
        """Keep only these samples' shared segment [B'] (the beams' rows are gathered by keep_rows)."""
        self.prompt_keys = [k.index_select(0, samples) for k in self.prompt_keys]
        self.prompt_values = [v.index_select(0, samples) for v in self.prompt_values]
        self.prompt_positions = self.prompt_positions.index_select(0, samples)
        self.gen_positions = self.gen_positions.index_select(0, samples)
        if self.prompt_bias is not None:
            self.prompt_bias = self.prompt_bias.index_select(0, samples)

    @property
    def shared_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.prompt_keys, self.prompt_values))

    @property
    def per_beam_nbytes(self) -> int:
        return self.gen_keys.nbytes + self.gen_values.nbytes

    @property
    def nbytes(self) -> int:
        return self.shared_nbytes + self.per_beam_nbytes


def gather_rows_in_place(buffers: tuple[torch.Tensor, ...], rows: torch.Tensor, length: int) -> None:
    """buffer[:, i, ..., :length] = buffer[:, rows[i], ..., :length] for each [L, N, H, S, D] buffer, moving
    only the rows whose source changed: most beams usually continue themselves, so a reorder copies
    a fraction of the cache (one small host sync to find them)."""
    moved = torch.nonzero(rows != torch.arange(rows.numel(), device=rows.device)).flatten()  # [M]
    if moved.numel() == 0:
        return
    sources = rows[moved]
    for buffer in buffers:
        buffer[:, moved, :, :length] = buffer[:, sources, :, :length]  # the right side is gathered first


def _fold_bias(mask: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    """An additive bias [N, 1|H, T, S] in the folded layout [N, 1|Hkv, G*T, S]."""
    N, h, T, S = mask.shape
    if h == 1:
        return mask.expand(N, 1, T, S).repeat(1, 1, group, 1) if group > 1 else mask  # [N, 1, G*T, S]
    return mask.reshape(N, num_kv_heads, group * T, S)  # [N, H, T, S] -> [N, Hkv, G*T, S]
