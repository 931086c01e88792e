"""The Llama family: Llama 1-3, Mistral, Qwen2, Qwen3, Granite, SmolLM2 and SmolLM3 are one decoder
with config flags (read by models/llama_config.py).

Pre-norm blocks (RMSNorm), rotary positions (half-split layout), grouped-query attention,
gated SiLU MLP. Flags: q/k/v bias (Qwen2), tied embeddings, RoPE scaling (GGUF: the ``rope_freqs``
divisors), sliding window (Mistral), per-head q/k norms (Qwen3), layers without RoPE (SmolLM3),
embedding / residual / logits multipliers (Granite). Weights are held as plain tensors under
canonical names and used functionally.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch

from ..cache.view import CacheView
from .base import ModelBase, Weight
from ..config import ModelConfig
from ..layers.linear import embed, linear
from ..layers.products import KernelChoice, Products
from ..layers.threads import on_one_thread
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.positions import NoRotation, RotaryEmbedding, rope_inverse_frequencies
from ..layers.elementwise import add_rms_norm, qkv_heads, rms_norm
from .llama_decode import FusedDecode
from .llama_config import config_from_gguf, config_from_hf  # noqa: F401  (the registry's entry points)

# Canonical weight name -> name in each format. "{layer}" is the block index.
HF_NAMES = {
    "rope_freqs.weight": "rope_freqs.weight",  # a GGUF tensor (below); no HF checkpoint has it
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
    "layers.{layer}.q.weight": "model.layers.{layer}.self_attn.q_proj.weight",
    "layers.{layer}.k.weight": "model.layers.{layer}.self_attn.k_proj.weight",
    "layers.{layer}.v.weight": "model.layers.{layer}.self_attn.v_proj.weight",
    "layers.{layer}.q.bias": "model.layers.{layer}.self_attn.q_proj.bias",
    "layers.{layer}.k.bias": "model.layers.{layer}.self_attn.k_proj.bias",
    "layers.{layer}.v.bias": "model.layers.{layer}.self_attn.v_proj.bias",
    "layers.{layer}.o.weight": "model.layers.{layer}.self_attn.o_proj.weight",
    "layers.{layer}.o.bias": "model.layers.{layer}.self_attn.o_proj.bias",
    "layers.{layer}.q_norm.weight": "model.layers.{layer}.self_attn.q_norm.weight",
    "layers.{layer}.k_norm.weight": "model.layers.{layer}.self_attn.k_norm.weight",
    "layers.{layer}.mlp_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.gate.weight": "model.layers.{layer}.mlp.gate_proj.weight",
    "layers.{layer}.up.weight": "model.layers.{layer}.mlp.up_proj.weight",
    "layers.{layer}.down.weight": "model.layers.{layer}.mlp.down_proj.weight",
    "layers.{layer}.gate.bias": "model.layers.{layer}.mlp.gate_proj.bias",
    "layers.{layer}.up.bias": "model.layers.{layer}.mlp.up_proj.bias",
    "layers.{layer}.down.bias": "model.layers.{layer}.mlp.down_proj.bias",
}
GGUF_NAMES = {
    "rope_freqs.weight": "rope_freqs.weight",  # Llama 3's scaled RoPE: inv_freq divided by these
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{layer}.attn_norm.weight": "blk.{layer}.attn_norm.weight",
    "layers.{layer}.q.weight": "blk.{layer}.attn_q.weight",
    "layers.{layer}.k.weight": "blk.{layer}.attn_k.weight",
    "layers.{layer}.v.weight": "blk.{layer}.attn_v.weight",
    "layers.{layer}.q.bias": "blk.{layer}.attn_q.bias",
    "layers.{layer}.k.bias": "blk.{layer}.attn_k.bias",
    "layers.{layer}.v.bias": "blk.{layer}.attn_v.bias",
    "layers.{layer}.o.weight": "blk.{layer}.attn_output.weight",
    "layers.{layer}.o.bias": "blk.{layer}.attn_output.bias",
    "layers.{layer}.q_norm.weight": "blk.{layer}.attn_q_norm.weight",
    "layers.{layer}.k_norm.weight": "blk.{layer}.attn_k_norm.weight",
    "layers.{layer}.mlp_norm.weight": "blk.{layer}.ffn_norm.weight",
    "layers.{layer}.gate.weight": "blk.{layer}.ffn_gate.weight",
    "layers.{layer}.up.weight": "blk.{layer}.ffn_up.weight",
    "layers.{layer}.down.weight": "blk.{layer}.ffn_down.weight",
}
# HF (and GGUF, once in HF layout) store these [out, in]; the canonical layout is [in, out].
OUT_IN_WEIGHTS = ("q.weight", "k.weight", "v.weight", "o.weight", "gate.weight", "up.weight", "down.weight",
                  "lm_head.weight")
# Buffers some checkpoints carry that are not weights.
IGNORED_NAME_PATTERNS = (r".*rotary_emb\.inv_freq$",)
FLOAT32_WEIGHTS = ("rope_freqs.weight",)  # divisors of the float64 frequencies: not rounded to bf16 / fp16
# GGUF architectures whose converter permutes Q/K rows for interleaved RoPE (llama.cpp's ROPE_TYPE_NORM)
PERMUTED_QK_ARCHITECTURES = ("llama", "mistral", "granite", "smollm3")


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    """(required, optional) canonical names for this config."""
    required = ["embed.weight", "norm.weight"]
    optional = ["rope_freqs.weight"]  # GGUF only
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    per_layer = ["attn_norm.weight", "q.weight", "k.weight", "v.weight", "o.weight", "mlp_norm.weight",
                 "gate.weight", "up.weight", "down.weight"]
    if config.attention_bias:
        per_layer += ["q.bias", "k.bias", "v.bias"]
    if config.attention_out_bias:
        per_layer += ["o.bias"]
    if config.mlp_bias:
        per_layer += ["gate.bias", "up.bias", "down.bias"]
    if config.qk_norm == "head":
        per_layer += ["q_norm.weight", "k_norm.weight"]
    required += [f"layers.{{layer}}.{name}" for name in per_layer]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the checkpoint (HF) layout; the loader checks every weight against it."""
    C, V, I = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = {"attn_norm.weight": (C,), "q.weight": (q, C), "k.weight": (kv, C), "v.weight": (kv, C),
             "q.bias": (q,), "k.bias": (kv,), "v.bias": (kv,), "o.weight": (C, q), "o.bias": (C,),
             "mlp_norm.weight": (C,), "gate.weight": (I, C), "up.weight": (I, C), "down.weight": (C, I),
             "gate.bias": (I,), "up.bias": (I,), "down.bias": (C,),
             "q_norm.weight": (config.head_dim,), "k_norm.weight": (config.head_dim,)}
    rotary_pairs = int(config.head_dim * config.partial_rotary_factor) // 2
    return {"embed.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C), "rope_freqs.weight": (rotary_pairs,),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undo the Q/K row permutation llama.cpp's converter applies.

    HF stores Q/K rows for half-split RoPE (pairs i, i + D/2); GGUF llama files store them for
    interleaved RoPE (pairs 2i, 2i + 1). The converter maps, per head, row (half h, index i) to
    row (i, half h): rows [H, 2, D/2] -> [H, D/2, 2]. We invert it, rows [H, D/2, 2] -> [H, 2, D/2],
    so one half-split RoPE serves both formats. Applies to weights and biases alike.
    """
    if config.architecture not in PERMUTED_QK_ARCHITECTURES:  # qwen2, qwen3 GGUFs keep HF (NeoX) order
        return weight
    if canonical.endswith((".q.weight", ".q.bias")):
        heads = config.num_heads
    elif canonical.endswith((".k.weight", ".k.bias")):
        heads = config.num_kv_heads
    else:
        return weight
    rest = weight.shape[1:]
    rotary = weight.reshape(heads, config.head_dim // 2, 2, *rest)  # [H, D/2, 2, ...]
    return rotary.swapaxes(1, 2).reshape(weight.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


@dataclass(frozen=True, slots=True, eq=False)
class LlamaBlock:
    """One decoder block's weights: norm scales [C]; Q, K, V as one fused product and gate, up as
    another (``FusedProjection``); o and down as [out, in] views of [in, out] buffers; a bias per
    projection where the checkpoint has one (Qwen2: q, k, v); Qwen3's q and k norm scales [D]
    repeated over their heads ([H + Hkv, D]: one multiply scales every query and key head)."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: FusedProjection
    o: Weight
    gate_up: FusedProjection
    down: Weight
    o_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None = None


class LlamaModel(ModelBase):
    """Decoder-only Llama-family model over canonical weights."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        self.take_ends(config, weights)
        self.layers = [
            LlamaBlock(
                attn_norm=weights[f"layers.{i}.attn_norm.weight"],
                mlp_norm=weights[f"layers.{i}.mlp_norm.weight"],
                **self.fused_products(weights, i),
                # [in, out] buffers seen as [out, in]: linear() then runs x @ buffer (the fast layout)
                **{name: weights[f"layers.{i}.{name}.weight"].t() for name in ("o", "down")},
                **{f"{name}_bias": weights.get(f"layers.{i}.{name}.bias") for name in ("o", "down")},
                qk_norm=self._qk_norm(weights, i),
            )
            for i in range(config.num_layers)
        ]
        # the norm after each block: the next block's input norm, the final norm after the last
        self.next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        self.layer_windows = config.layer_windows  # None: full attention; else the layer's window
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        inv_freq, attention_factor = rope_inverse_frequencies(
            rotary_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        if "rope_freqs.weight" in weights:  # GGUF (Llama 3): llama.cpp divides each frequency by its factor
            inv_freq = inv_freq / weights["rope_freqs.weight"].to(device="cpu", dtype=torch.float64)
        self.rope = RotaryEmbedding(rotary_dim, inv_freq, attention_factor)
        # every rotating layer shares one rotary table; NoPE layers (SmolLM3) rotate by the identity
        no_rotation = NoRotation(rotary_dim)
        self.layer_ropes = [no_rotation if i in config.nope_layers else self.rope for i in range(config.num_layers)]
        self.scale = config.attention_scale or config.head_dim**-0.5
        # pure decode steps: one op per block, or None (the op has no q/k norms nor residual multiplier)
        plain = config.qk_norm is None and config.residual_multiplier == 1.0
        self.fused_decode = FusedDecode.for_model(self) if plain else None

    def _qk_norm(self, weights: dict[str, torch.Tensor], i: int) -> torch.Tensor | None:
        """Qwen3's q and k norm scales of block i as [H + Hkv, D], or None without q/k norms."""
        q_norm, k_norm = weights.get(f"layers.{i}.q_norm.weight"), weights.get(f"layers.{i}.k_norm.weight")
        if q_norm is None:
            return None
        return torch.cat((q_norm.expand(self.config.num_heads, -1), k_norm.expand(self.config.num_kv_heads, -1)))

    def fused_products(self, weights: dict[str, torch.Tensor], i: int) -> dict[str, FusedProjection]:
        """Block i's ``qkv`` and ``gate_up`` products from the checkpoint's separate matrices
        (Phi-3, whose checkpoints hold them fused already, overrides this)."""
        return {"qkv": fuse_projections(weights, [f"layers.{i}.{name}" for name in ("q", "k", "v")]),
                "gate_up": fuse_projections(weights, [f"layers.{i}.{name}" for name in ("gate", "up")])}

    @on_one_thread
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: CacheView,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """tokens, positions [B, T]; the view (cache/view.py) stores this forward's K/V and attends over
        its keys under its own masks (``NoCache``: within these tokens only). Returns logits [B, T, V]
        if ``all_logits``, [B, K, V] at the token indices ``logits_at`` [K], else [B, 1, V] for the
        last token."""
        cfg, p = self.config, cache.products  # the rows' roles and thread budget (layers/products.py)
        B, T = tokens.shape
        H, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if self.fused_decode is not None and not (hidden or all_logits):  # one token: maybe the whole step in one op
            logits = self.fused_decode.whole_step(cache, tokens, positions, logits_at)  # [1, 1, V] or None
            if logits is not None:
                return logits
        x = embed(tokens, self.embed)  # [B, T, C]
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier  # Granite
        # cos, signed sin [B, T, 1, rot] per rotary table (NoPE layers: the identity's): once per forward
        tables = {id(rope): rope.tables(positions, x.dtype) for rope in set(self.layer_ropes)}
        residual_scale = cfg.residual_multiplier
        # h: the normed input of the next sub-block; each residual add is fused with the norm after it
        h = rms_norm(x, self.layers[0].attn_norm, cfg.norm_eps)
        fused = self.fused_decode.step(cache, x) if self.fused_decode is not None else None
        stacked = fused.every_block(x, h, *next(iter(tables.values()))) if fused is not None and len(tables) == 1 else None
        if stacked is not None:
            x, h = stacked  # every block in one op (models/llama_decode.py); the loop below has nothing to run
        blocks = enumerate(zip(self.layers, self.next_norms)) if stacked is None else ()
        for index, (layer, next_norm) in blocks:
            rotary = tables[id(self.layer_ropes[index])]
            if fused is not None and (block := fused(index, x, h, *rotary)) is not None:
                x, h = block  # the same ops from C++ (models/llama_decode.py)
                continue
            # [B, H or Hkv, T, D]: q and k normed per head (Qwen3) and rotated
            q, k, v = qkv_heads(layer.qkv(h, p), H, Hkv, *rotary, layer.qk_norm, cfg.norm_eps, threads=p.threads)
            o = cache.attend(index, q, k, v, self.scale)  # [B, H, T, D]
            o = o.transpose(1, 2).reshape(B, T, H * D)  # [B, T, H*D]
            attended = linear(o, layer.o, layer.o_bias, products=p)  # [B, T, C]
            if residual_scale != 1.0:
                attended = attended * residual_scale  # Granite
            x, h = add_rms_norm(x, attended, layer.mlp_norm, cfg.norm_eps, threads=p.threads)
            mlp = linear(layer.gate_up.gated(h, cfg.hidden_act, p), layer.down, layer.down_bias,
                         products=p)  # [B, T, C]
            if residual_scale != 1.0:
                mlp = mlp * residual_scale
            # the last block's output goes through the final norm (row-wise, so before output_rows)
            x, h = add_rms_norm(x, mlp, next_norm, cfg.norm_eps, threads=p.threads)
        rows = self.output_rows(h, all_logits, logits_at)  # [B, T or K or 1, C]
        return rows if hidden else self.head(rows, p)  # hidden: the final-normed states (embeddings)

    def head(self, hidden: torch.Tensor, products: Products) -> torch.Tensor:
        logits = linear(hidden, self.lm_head, products=products)  # [B, K, V]
        divisor = self.config.logits_divisor
        return logits if divisor == 1.0 else logits / divisor  # Granite's logits_scaling
