"""Valid raw GGUF blocks of random weights, and a tiny llama GGUF made of them, for tests of the repacker, the
kernels and native loading (no checkpoint)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize as gguf_quantize
from tiny_gguf import EOT, MERGES, TOKEN_TYPES, TOKENS

K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K)
# offsets of the float16 super-scales in a K-quant block: d and dmin (Q4_K, Q5_K), d (Q6_K)
K_SCALE_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}


def random_blocks(qtype: QT, shape: tuple[int, int], seed: int) -> np.ndarray:
    """Valid raw blocks [N, bytes per row] of a [N, K] tensor, weights of magnitude ~0.1.

    gguf-py cannot quantize K-quants, so those are random bytes (every bit pattern of codes and
    6-bit sub-scales is a valid block) with the float16 super-scales set small and finite."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return gguf_quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block_size, type_size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(1e-4, 4e-4, raw.shape[:2]).astype(np.float16)
        raw[..., offset:offset + 2] = scale[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2  # K-quant rows need multiples of 256


def write_tiny_llama(path, qtype: QT, tied: bool) -> str:
    """A random 2-layer llama GGUF whose matrices (and token embedding) are all ``qtype`` blocks."""
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    matrices = {"token_embd.weight": (len(TOKENS), HIDDEN)}
    if not tied:
        matrices["output.weight"] = (len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        matrices |= {f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                     f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                     f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN),
                     f"blk.{i}.ffn_up.weight": (FFN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(EOT)
    writer.add_eos_token_id(EOT)
    for seed, (name, shape) in enumerate(matrices.items()):
        writer.add_tensor(name, random_blocks(qtype, shape, seed), raw_dtype=qtype)
    for name in ["output_norm.weight"] + [f"blk.{i}.{n}" for i in range(LAYERS) for n in ("attn_norm.weight",
                                                                                        "ffn_norm.weight")]:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
