"""The compiled ops' shape functions ("fake" kernels, registered by ``ops.py`` once the extension is loaded):
torch.compile / FakeTensor tracing run them instead of the C++ code, so a compiled decode step (fullgraph)
traces through quantized products."""

from __future__ import annotations

import torch


def _outputs(codes, scale, outputs: int) -> int:
    """N of a quantized weight's op arguments: rows of scale [N, K/G], or ``outputs`` of a tiled weight
    (codes [N/8 rounded up, K/32, bytes], the last tile padded; -1: every tile's 8 rows)."""
    if codes.dim() == 2:
        return scale.shape[0]
    return outputs if outputs >= 0 else codes.shape[0] * 8


def register_fake() -> None:
    """The op's shape function (a "fake" kernel): torch.compile / FakeTensor tracing run it instead of
    the C++ code, so a compiled decode step (fullgraph) traces through quantized products."""
    @torch.library.register_fake("fastdecode_kernels::qmatmul")
    def _qmatmul_fake(x, codes, scale, mins, bits, group, threads, activation_bits=8, outputs=-1,
                      bias=None):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], _outputs(codes, scale, outputs)))

    @torch.library.register_fake("fastdecode_kernels::exact_qmatmul")
    def _exact_qmatmul_fake(x, codes, scale, mins, bits, group, threads, outputs=-1):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], _outputs(codes, scale, outputs)))

    @torch.library.register_fake("fastdecode_kernels::prompt_qmatmul")
    def _prompt_qmatmul_fake(x, codes, scale, threads, bias=None):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], codes.shape[0]))

    @torch.library.register_fake("fastdecode_kernels::tiled_gemm")
    def _tiled_gemm_fake(x, codes, scale, mins, bits, outputs, threads, bias=None):  # x [M, K] -> [M, N]
        return x.new_empty((x.shape[0], _outputs(codes, scale, outputs)))

    @torch.library.register_fake("fastdecode_kernels::tiled_gated_gemm")
    def _tiled_gated_gemm_fake(x, codes, scale, mins, bits, outputs, threads, activation):  # x [M, K] -> [M, N / 2]
        return x.new_empty((x.shape[0], outputs // 2))

    @torch.library.register_fake("fastdecode_kernels::dequantize")
    def _dequantize_fake(codes, scale, mins, bits, group, threads, outputs=-1):  # -> float32 [N, K]
        inputs = codes.shape[1] * 32 if codes.dim() == 3 else codes.shape[1] * 8 // bits  # K
        return scale.new_empty((_outputs(codes, scale, outputs), inputs), dtype=torch.float32)

    @torch.library.register_fake("fastdecode_kernels::paged_attention")
    def _paged_attention_fake(q, keys, values, k_new, v_new, write_slots, table, key_start, positions, block, window,
                              scale, bias):  # q [B, H, D] -> [B, H, D] (keys, values written in place)
        return q.new_empty(q.shape)

    @torch.library.register_fake("fastdecode_kernels::prompt_attention")
    def _prompt_attention_fake(q, k, v, mask, scale, threads):  # q [B, H, T, D] -> same
        B, H, T, D = q.shape
        return q.new_empty((B, T, H, D)).transpose(1, 2)  # [B, T, H, D] -> [B, H, T, D]

    @torch.library.register_fake("fastdecode_kernels::beam_candidates")
    def _beam_candidates_fake(logits, running, banned, K, keep, threads=1, row_banned=None):  # [B*K, V] -> [B, keep] x2
        B = logits.shape[0] // K
        return logits.new_empty((B, keep)), logits.new_empty((B, keep), dtype=torch.long)

    @torch.library.register_fake("fastdecode_kernels::beam_update")
    def _beam_update_fake(top_scores, top_index, eos, V, step, max_new, offer_divisor, best_divisor, stop_when_done,
                          running, running_tokens, fin_tokens, fin_length, fin_scores, fin_done, improvable):
        return top_index.new_empty((2 * running.numel() + 1,))  # [2K + 1] int64 (the state updated in place)

    @torch.library.register_fake("fastdecode_kernels::cross_attention")
    def _cross_attention_fake(q, keys, values, lengths, scale, threads=1):  # q [B, H, T, D] -> [B, H, T, D]
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastdecode_kernels::paged_cross_attention")
    def _paged_cross_attention_fake(q, keys, values, table, lengths, scale, threads=1):  # -> [B, H, T, D]
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastdecode_kernels::float_matmul")
    def _float_matmul_fake(x, weight, bias, threads, in_place_rows, aliased_rows):  # x [M, K] @ weight [K, N] -> [M, N]
        return x.new_empty((x.shape[0], weight.shape[1]))

    @torch.library.register_fake("fastdecode_kernels::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("fastdecode_kernels::add_rms_norm")
    def _add_rms_norm_fake(x, delta, delta_weight, weight, eps):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("fastdecode_kernels::qkv_heads")
    def _qkv_heads_fake(qkv, num_heads, num_kv_heads, norm_weight, eps, cos, sin):  # [B, T, (H + 2 Hkv) D]
        B, T, width = qkv.shape
        D = width // (num_heads + 2 * num_kv_heads)
        return (qkv.new_empty((B, num_heads, T, D)), qkv.new_empty((B, num_kv_heads, T, D)),
                qkv.new_empty((B, num_kv_heads, T, D)))  # q [B, H, T, D], k and v [B, Hkv, T, D]

    @torch.library.register_fake("fastdecode_kernels::argmax_rows")
    def _argmax_rows_fake(logits):  # [R, V] -> [R]
        return logits.new_empty((logits.shape[0],), dtype=torch.long)

    @torch.library.register_fake("fastdecode_kernels::gated")
    def _gated_fake(gate_up, activation):  # [..., 2I] -> [..., I]
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


