"""Gemma 3 (text): local and global attention layers, multi-query with 256-wide heads.

A pre- and post-norm block: RMSNorm before and after both the attention and the MLP (four norms
per block), each scaling by (1 + w); RMSNorm on every query and key head (q/k norms); GELU-tanh
gated MLP; token embeddings multiplied by sqrt(hidden) (rounded to the weight dtype, as
transformers does). Layers come in two attention kinds (``ModelConfig.layer_types``): sliding
layers see the last ``sliding_window`` positions and rotate with RoPE base 10,000
(``rope_local_base_freq``); full layers see everything and use RoPE base 1,000,000 (possibly
scaled). Queries are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``.

Checkpoints: HF ``Gemma3ForCausalLM`` (``gemma3_text``) folders and GGUF ``gemma3`` files.
llama.cpp's converter stores every Gemma norm weight with the 1 already added, and keeps Q/K rows
in HF (half-split) order; ``gguf_to_hf_layout`` takes the 1 back off, so one canonical form (HF's
w) serves both and the model adds 1 once at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cache.view import CacheView
from ..config import FULL, SLIDING, ModelConfig
from ..errors import UnsupportedModelError
from ..layers.attention import merge_heads
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.linear import ACTIVATIONS, embed, linear
from ..layers.products import KernelChoice, Products
from ..layers.threads import on_one_thread
from ..layers.positions import RotaryEmbedding, rope_inverse_frequencies
from ..layers.elementwise import add_rms_norm, qkv_heads, rms_norm
from .base import ModelBase, Weight, token_id_list
from .gguf_fields import gguf_text_fields

_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
_NORMS = ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm")

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{layer}.attn_norm.weight": "model.layers.{layer}.input_layernorm.weight",
    "layers.{layer}.post_attn_norm.weight": "model.layers.{layer}.post_attention_layernorm.weight",
    "layers.{layer}.mlp_norm.weight": "model.layers.{layer}.pre_feedforward_layernorm.weight",
    "layers.{layer}.post_mlp_norm.weight": "model.layers.{layer}.post_feedforward_layernorm.weight",
    "layers.{layer}.q_norm.weight": "model.layers.{layer}.self_attn.q_norm.weight",
    "layers.{layer}.k_norm.weight": "model.layers.{layer}.self_attn.k_norm.weight",
    **{f"layers.{{layer}}.{name}.weight": f"model.layers.{{layer}}.self_attn.{name}_proj.weight" for name in "qkvo"},
    **{f"layers.{{layer}}.{name}.weight": f"model.layers.{{layer}}.mlp.{name}_proj.weight"
       for name in ("gate", "up", "down")},
}
GGUF_NAMES = {
    "embed.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "layers.{layer}.attn_norm.weight": "blk.{layer}.attn_norm.weight",
    "layers.{layer}.post_attn_norm.weight": "blk.{layer}.post_attention_norm.weight",
    "layers.{layer}.mlp_norm.weight": "blk.{layer}.ffn_norm.weight",
    "layers.{layer}.post_mlp_norm.weight": "blk.{layer}.post_ffw_norm.weight",
    "layers.{layer}.q_norm.weight": "blk.{layer}.attn_q_norm.weight",
    "layers.{layer}.k_norm.weight": "blk.{layer}.attn_k_norm.weight",
    "layers.{layer}.q.weight": "blk.{layer}.attn_q.weight",
    "layers.{layer}.k.weight": "blk.{layer}.attn_k.weight",
    "layers.{layer}.v.weight": "blk.{layer}.attn_v.weight",
    "layers.{layer}.o.weight": "blk.{layer}.attn_output.weight",
    "layers.{layer}.gate.weight": "blk.{layer}.ffn_gate.weight",
    "layers.{layer}.up.weight": "blk.{layer}.ffn_up.weight",
    "layers.{layer}.down.weight": "blk.{layer}.ffn_down.weight",
}
OUT_IN_WEIGHTS = tuple(f"{name}.weight" for name in _PROJECTIONS) + ("lm_head.weight",)
IGNORED_NAME_PATTERNS = (r".*rotary_emb\..*inv_freq$", r".*embed_scale$", r"^rope_freqs\.weight$")
LOCAL_ROPE_THETA, GLOBAL_ROPE_THETA = 10_000.0, 1_000_000.0  # Gemma 3's defaults (and llama.cpp's)
SLIDING_WINDOW_PATTERN = 6  # five sliding layers, then one full layer (when a config lists no layer_types)


def weight_names(config: ModelConfig) -> tuple[list[str], list[str]]:
    required = ["embed.weight", "norm.weight"]
    optional = []
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    norms = _NORMS if config.family == "gemma3" else _NORMS[:4]  # Gemma 2: no q/k norms
    required += [f"layers.{{layer}}.{name}.weight" for name in norms + _PROJECTIONS]
    return required, optional


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the checkpoint (HF) layout; the loader checks every weight against it."""
    C, V, I, D = config.hidden_size, config.vocab_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * D, config.num_kv_heads * D
    layer = {"q.weight": (q, C), "k.weight": (kv, C), "v.weight": (kv, C), "o.weight": (C, q),
             "gate.weight": (I, C), "up.weight": (I, C), "down.weight": (C, I), "q_norm.weight": (D,),
             "k_norm.weight": (D,), **{f"{norm}.weight": (C,) for norm in _NORMS if norm not in ("q_norm", "k_norm")}}
    return {"embed.weight": (V, C), "norm.weight": (C,), "lm_head.weight": (V, C),
            **{f"layers.{{layer}}.{name}": shape for name, shape in layer.items()}}


def pattern_layer_types(num_layers: int, pattern: int) -> list[str]:
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]


def _refuse_unsupported(attn_softcap: Any, bidirectional: Any, attention_bias: Any = False) -> None:
    if attention_bias:
        raise UnsupportedModelError("Gemma 3 with attention_bias=True is not supported")
    if attn_softcap is not None:
        raise UnsupportedModelError("attention logit softcapping (attn_logit_softcapping) is not supported")
    if bidirectional:
        raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is not supported")


def hf_fields(hf: dict[str, Any], default_context: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields Gemma 2 and Gemma 3 configs name alike (their RoPE and layer
    pattern differ; each family's ``config_from_hf`` adds those)."""
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 256,
        intermediate_size=hf["intermediate_size"],
        max_position_embeddings=hf.get("max_position_embeddings", default_context),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        sliding_window=hf.get("sliding_window"),
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_id_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def gguf_fields(meta: dict[str, Any], tensor_names: set[str], default_context: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields Gemma 2 and Gemma 3 GGUF files name alike (keys under the file's
    architecture; ``gguf_text_fields`` and Gemma's own defaults). llama.cpp derives the query scale
    from the model size: its largest model (Gemma 2 27B, 46 layers; Gemma 3 27B, 62 layers) scales by
    hidden / heads instead of head_dim."""
    arch = meta["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    fields = gguf_text_fields(meta, tensor_names)
    hidden, num_heads, num_layers = fields["hidden_size"], fields["num_heads"], fields["num_layers"]
    head_dim = get("attention.key_length") or 256
    query_pre_attn_scalar = hidden // num_heads if (arch, num_layers) in (("gemma2", 46), ("gemma3", 62)) else head_dim
    return dict(
        fields,
        num_kv_heads=get("attention.head_count_kv") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=get("context_length", default_context),
        norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        hidden_act="gelu_pytorch_tanh",
        attention_scale=float(query_pre_attn_scalar) ** -0.5,
        final_logit_softcapping=get("final_logit_softcapping"),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Map a HF ``gemma3_text`` config (transformers 4.x ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling``, or 5.x ``rope_parameters`` keyed by layer type)."""
    _refuse_unsupported(hf.get("attn_logit_softcapping"), hf.get("use_bidirectional_attention"),
                        hf.get("attention_bias"))
    rope = hf.get("rope_parameters") or {}
    full_rope = dict(rope.get(FULL) or {})
    local_rope = dict(rope.get(SLIDING) or {})
    if local_rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError("scaled RoPE on sliding-window layers is not supported")
    scaling = hf.get("rope_scaling") or (full_rope if full_rope.get("rope_type", "default") != "default" else None)
    layer_types = hf.get("layer_types") or pattern_layer_types(
        hf["num_hidden_layers"],
        hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or SLIDING_WINDOW_PATTERN)
    return ModelConfig(
        family="gemma3",
        architecture=(hf.get("architectures") or ["Gemma3ForCausalLM"])[0],
        rope_theta=float(full_rope.get("rope_theta", hf.get("rope_theta", GLOBAL_ROPE_THETA))),
        rope_scaling=scaling,
        rope_local_theta=float(local_rope.get("rope_theta", hf.get("rope_local_base_freq", LOCAL_ROPE_THETA))),
        layer_types=list(layer_types),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
        **hf_fields(hf, 131_072),
    )


def config_from_gguf(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """GGUF ``gemma3``. llama.cpp keeps the local RoPE base (10,000) and the 5:1 layer pattern in its
    code, not in the file (the query scale: ``gguf_fields``)."""
    _refuse_unsupported(meta.get("gemma3.attn_logit_softcapping"), False)
    scaling = None
    if meta.get("gemma3.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": meta.get("gemma3.rope.scaling.factor")}
    pattern = meta.get("gemma3.attention.sliding_window_pattern") or SLIDING_WINDOW_PATTERN
    return ModelConfig(
        family="gemma3",
        rope_theta=float(meta.get("gemma3.rope.freq_base", GLOBAL_ROPE_THETA)),
        rope_scaling=scaling,
        rope_local_theta=LOCAL_ROPE_THETA,
        sliding_window=meta.get("gemma3.attention.sliding_window"),
        layer_types=pattern_layer_types(meta["gemma3.block_count"], pattern),
        **gguf_fields(meta, tensor_names, 131_072),
    )


def gguf_to_hf_layout(canonical: str, weight: np.ndarray, config: ModelConfig) -> np.ndarray:
    """llama.cpp stores Gemma norm weights as 1 + w (its RMSNorm multiplies by the weight as is):
    take the 1 back off. Q/K rows need nothing: llama.cpp rotates Gemma in the half-split (NeoX)
    layout, so its converter does not permute them."""
    if canonical.endswith("norm.weight"):
        return weight - np.float32(1.0)
    return weight


@dataclass(frozen=True, slots=True, eq=False)
class Gemma3Block:
    """One decoder block's weights: the (1 + w) norm scales ([C]; the q and k norms [D] repeated
    over their heads: [H + Hkv, D], so one multiply scales every query and key head; None for
    Gemma 2, which has none), Q, K, V as
    one fused product and gate, up as another (``FusedProjection``), o and down as [out, in]
    views of [in, out] buffers. No biases."""

    attn_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    post_mlp_norm: torch.Tensor
    qk_norm: torch.Tensor | None
    qkv: FusedProjection
    o: Weight
    gate_up: FusedProjection
    down: Weight


class Gemma3Model(ModelBase):
    """Decoder-only Gemma 3 text model over canonical weights (HF's norm weights w; scale 1 + w).
    Also Gemma 2 (models/gemma2.py): no q/k norm weights, one RoPE base for both attention kinds
    (``rope_local_theta`` equal to ``rope_theta``) and ``attention_softcapping`` set."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported")
        self.config = config
        self.embed = weights["embed.weight"]
        # sqrt(hidden) rounded to the weight dtype, as transformers multiplies (bf16: 55.4256 -> 55.5)
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5).to(self.embed.dtype))
        # the (1 + w) scales in float32 whatever the model's dtype: transformers adds the 1 in float32 and
        # scales before rounding (layers/elementwise.py's half-precision norm reads a float32 weight so)
        self.norm = 1.0 + weights["norm.weight"].float()
        self.lm_head = weights["lm_head.weight"].t()  # [C, V] buffer seen as [V, C] for linear()
        self.layers = [
            Gemma3Block(
                **{name: 1.0 + weights[f"layers.{i}.{name}.weight"].float() for name in _NORMS[:4]},  # (1 + w)
                qk_norm=torch.cat((1.0 + weights[f"layers.{i}.q_norm.weight"].float().expand(config.num_heads, -1),
                                   1.0 + weights[f"layers.{i}.k_norm.weight"].float().expand(config.num_kv_heads, -1)))
                if f"layers.{i}.q_norm.weight" in weights else None,
                qkv=fuse_projections(weights, [f"layers.{i}.{name}" for name in ("q", "k", "v")]),
                gate_up=fuse_projections(weights, [f"layers.{i}.{name}" for name in ("gate", "up")]),
                # [in, out] buffers seen as [out, in]: linear() then runs x @ buffer (the fast layout)
                **{name: weights[f"layers.{i}.{name}.weight"].t() for name in ("o", "down")},
            )
            for i in range(config.num_layers)
        ]
        # the norm after each block: the next block's input norm, the final norm after the last
        self.next_norms = [layer.attn_norm for layer in self.layers[1:]] + [self.norm]
        self.layer_windows = config.layer_windows
        inv_freq, factor = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling,
                                                    config.max_position_embeddings)
        local_inv_freq, _ = rope_inverse_frequencies(config.head_dim, config.rope_local_theta or config.rope_theta,
                                                     None, config.max_position_embeddings)
        self.ropes = {FULL: RotaryEmbedding(config.head_dim, inv_freq, factor),
                      SLIDING: RotaryEmbedding(config.head_dim, local_inv_freq)}
        self.layer_types = config.layer_types
        self.layer_ropes = [self.ropes[kind] for kind in config.layer_types]
        self.scale = config.attention_scale or config.head_dim**-0.5

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
        """tokens, positions [B, T] -> logits [B, T, V] if ``all_logits``, [B, K, V] at the token indices
        ``logits_at`` [K], else [B, 1, V]; ``cache``: the view it attends through (cache/view.py), which
        masks each layer by ``ModelConfig.layer_windows`` itself."""
        cfg, p = self.config, cache.products  # the rows' roles and thread budget (layers/products.py)
        eps = cfg.norm_eps
        B, T = tokens.shape
        H, Hkv = cfg.num_heads, cfg.num_kv_heads
        x = embed(tokens, self.embed) * self.embed_scale  # [B, T, C]
        # cos, signed sin [B, T, 1, D] per attention kind: once per forward, not per layer
        rotations = {kind: self.ropes[kind].tables(positions, x.dtype) for kind in set(self.layer_types)}
        # h: the normed input of the next sub-block; each residual add is fused with the norm after it
        h = rms_norm(x, self.layers[0].attn_norm, eps)
        for index, (layer, next_norm) in enumerate(zip(self.layers, self.next_norms)):
            # q [B, H, T, D], k, v [B, Hkv, T, D]; q and k RMS-normed per head (Gemma 3), scaled and rotated
            q, k, v = qkv_heads(layer.qkv(h, p), H, Hkv, *rotations[self.layer_types[index]], layer.qk_norm, eps,
                                threads=p.threads)
            o = cache.attend(index, q, k, v, self.scale,
                             cfg.attention_softcapping)  # [B, H, T, D]
            attended = linear(merge_heads(o), layer.o, products=p)  # [B, T, C]
            x, h = add_rms_norm(x, attended, layer.mlp_norm, eps, layer.post_attn_norm, threads=p.threads)
            mlp = linear(layer.gate_up.gated(h, cfg.hidden_act, p), layer.down, products=p)  # [B, T, C]
            # the last block's output goes through the final norm (row-wise, so before output_rows)
            x, h = add_rms_norm(x, mlp, next_norm, eps, layer.post_mlp_norm, threads=p.threads)
        rows = self.output_rows(h, all_logits, logits_at)  # [B, T or K or 1, C]
        return rows if hidden else self.head(rows, p)  # hidden: the final-normed states (embeddings)

    def head(self, hidden: torch.Tensor, products: Products) -> torch.Tensor:
        logits = linear(hidden, self.lm_head, products=products)  # [B, K, V]
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
