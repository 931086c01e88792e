"""BART, mBART and Marian: one encoder-decoder with config flags.

All three: a bidirectional encoder and a causal decoder whose layers also attend to the encoder
output (cross-attention), q/k/v/o biases, LayerNorm, a GELU (or ReLU/SiLU) FFN, one token
embedding shared by encoder, decoder and (tied) LM head, and a ``final_logits_bias`` on the logits.
Flags:
- BART: learned positions looked up at ``position + 2`` (fairseq's padding offset), post-LN,
  a LayerNorm right after the embeddings (``layernorm_embedding``), optional sqrt(d) embedding scale.
- mBART: the same but pre-LN, with a final LayerNorm closing the encoder and the decoder.
- Marian: fixed sinusoidal positions (no offset, not stored in the checkpoint), post-LN, no
  embedding LayerNorm, usually ``scale_embedding``; its own ``decoder_start_token_id`` (the pad id).

The model is functional over canonical weights and owns nothing per request: the engine
(engine/cross.py at admission; generation/reference.py for the naive loop) calls
``encode`` once, ``cross_kv`` once per layer, then ``decode`` per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from .base import ModelBase, Weight, token_id_list
from ..config import EncoderDecoderConfig, derived_head_dim
from ..errors import UnsupportedModelError
from ..layers.attention import attention, merge_heads, split_heads
from ..layers.fused import FusedProjection, fuse_projections
from ..layers.linear import ACTIVATIONS, embed, linear
from ..layers.products import KernelChoice, Products
from ..cache.view import CacheView
from ..layers.threads import on_one_thread
from ..layers.positions import sinusoidal_table
from .seq2seq import check_tied, decoder_start_token, padding_bias

if TYPE_CHECKING:  # the engine's views a decoder step attends through
    from ..engine.cross import CrossStep, EncodedSources

# Canonical name -> HF sublayer name, per layer of each stack.
_ENCODER_LAYER = {
    "attn_norm": "self_attn_layer_norm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
    "v": "self_attn.v_proj", "o": "self_attn.out_proj", "mlp_norm": "final_layer_norm", "up": "fc1", "down": "fc2",
}
_DECODER_LAYER = {
    **_ENCODER_LAYER,
    "cross_norm": "encoder_attn_layer_norm", "cross_q": "encoder_attn.q_proj", "cross_k": "encoder_attn.k_proj",
    "cross_v": "encoder_attn.v_proj", "cross_o": "encoder_attn.out_proj",
}
_KINDS = ("weight", "bias")
# Block fields that are one fused product of several canonical projections (layers/fused.py).
_FUSED = {"qkv": ("q", "k", "v"), "cross_kv": ("cross_k", "cross_v")}

HF_NAMES = {
    "embed.weight": "model.shared.weight",
    # transformers ties these to model.shared (in memory they are the same tensor; saved folders drop them)
    "encoder_embed.weight": "model.encoder.embed_tokens.weight",
    "decoder_embed.weight": "model.decoder.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "final_logits_bias": "final_logits_bias",
    **{f"{stack}.pos_embed.weight": f"model.{stack}.embed_positions.weight" for stack in ("encoder", "decoder")},
    **{f"{stack}.embed_norm.{kind}": f"model.{stack}.layernorm_embedding.{kind}"
       for stack in ("encoder", "decoder") for kind in _KINDS},
    **{f"{stack}.norm.{kind}": f"model.{stack}.layer_norm.{kind}"
       for stack in ("encoder", "decoder") for kind in _KINDS},
    **{f"encoder.layers.{{encoder_layer}}.{name}.{kind}": f"model.encoder.layers.{{encoder_layer}}.{hf}.{kind}"
       for name, hf in _ENCODER_LAYER.items() for kind in _KINDS},
    **{f"decoder.layers.{{layer}}.{name}.{kind}": f"model.decoder.layers.{{layer}}.{hf}.{kind}"
       for name, hf in _DECODER_LAYER.items() for kind in _KINDS},
}
# HF stores these [out, in]; the canonical layout is [in, out] (suffix match: cross_q.weight too).
OUT_IN_WEIGHTS = ("q.weight", "k.weight", "v.weight", "o.weight", "up.weight", "down.weight", "lm_head.weight")
# Marian's sinusoidal tables are buffers, not weights; old fairseq conversions carry "version" tensors.
IGNORED_NAME_PATTERNS = (r"^model\.(en|de)coder\.embed_positions\.weight$", r".*\.version$")


def weight_names(config: EncoderDecoderConfig) -> tuple[list[str], list[str]]:
    """(required, optional) canonical names. ``final_logits_bias`` is optional as in transformers (zeros)."""
    stacks = ("encoder", "decoder")
    required = ["embed.weight"]
    optional = ["encoder_embed.weight", "decoder_embed.weight", "final_logits_bias"]
    (optional if config.tie_word_embeddings else required).append("lm_head.weight")
    if config.position_kind == "learned":
        required += [f"{stack}.pos_embed.weight" for stack in stacks]
    if config.embedding_norm:
        required += [f"{stack}.embed_norm.{kind}" for stack in stacks for kind in _KINDS]
    if config.final_norm:
        required += [f"{stack}.norm.{kind}" for stack in stacks for kind in _KINDS]
    required += [f"encoder.layers.{{encoder_layer}}.{name}.{kind}" for name in _ENCODER_LAYER for kind in _KINDS]
    required += [f"decoder.layers.{{layer}}.{name}.{kind}" for name in _DECODER_LAYER for kind in _KINDS]
    return required, optional


def weight_shapes(config: EncoderDecoderConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the HF layout ([out, in] linear weights)."""
    C, V = config.hidden_size, config.vocab_size
    positions = (config.max_position_embeddings + config.position_offset, C)
    shapes = {"embed.weight": (V, C), "encoder_embed.weight": (V, C), "decoder_embed.weight": (V, C),
              "lm_head.weight": (V, C), "final_logits_bias": (1, V)}
    for stack in ("encoder", "decoder"):
        shapes[f"{stack}.pos_embed.weight"] = positions
        for part in ("embed_norm", "norm"):
            shapes.update({f"{stack}.{part}.weight": (C,), f"{stack}.{part}.bias": (C,)})
    for stack, layer, ffn in (("encoder", "encoder_layer", config.encoder_intermediate_size),
                              ("decoder", "layer", config.intermediate_size)):
        names = _ENCODER_LAYER if stack == "encoder" else _DECODER_LAYER
        for name in names:
            if name.endswith("norm"):
                weight = (C,)
            else:
                weight = {"up": (ffn, C), "down": (C, ffn)}.get(name, (C, C))
            shapes[f"{stack}.layers.{{{layer}}}.{name}.weight"] = weight
            shapes[f"{stack}.layers.{{{layer}}}.{name}.bias"] = weight[:1]
    return shapes


def config_from_hf(hf: dict[str, Any]) -> EncoderDecoderConfig:
    model_type = hf.get("model_type", "bart")
    if model_type not in ("bart", "mbart", "marian"):
        raise UnsupportedModelError(f"model_type {model_type!r} is not a BART-family model")
    marian, mbart = model_type == "marian", model_type == "mbart"
    if marian and hf.get("share_encoder_decoder_embeddings") is False:
        raise UnsupportedModelError("Marian with share_encoder_decoder_embeddings=False (separate vocabularies) "
                                    "is not supported")
    if marian and hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
        raise UnsupportedModelError("Marian with a decoder_vocab_size different from vocab_size is not supported")
    hidden = hf["d_model"]
    heads = hf["decoder_attention_heads"]
    if hidden % heads or hidden % hf["encoder_attention_heads"]:
        raise ValueError(f"d_model {hidden} is not a multiple of the attention heads")
    positions = hf["max_position_embeddings"]
    return EncoderDecoderConfig(
        family="bart",
        architecture=(hf.get("architectures") or [model_type])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["decoder_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=derived_head_dim(hidden, heads, ("d_model", "decoder_attention_heads")),
        intermediate_size=hf["decoder_ffn_dim"],
        max_position_embeddings=positions,
        norm_eps=1e-5,  # nn.LayerNorm's default, which every BART-family layer norm uses
        hidden_act=hf.get("activation_function", "gelu"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=True,
        attention_out_bias=True,
        mlp_bias=True,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_id_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        num_encoder_layers=hf["encoder_layers"],
        num_encoder_heads=hf["encoder_attention_heads"],
        encoder_intermediate_size=hf["encoder_ffn_dim"],
        decoder_start_token_id=decoder_start_token(hf),
        forced_bos_token_id=hf.get("forced_bos_token_id"),
        forced_eos_token_id=token_id_list(hf.get("forced_eos_token_id")),
        max_source_positions=positions,
        max_target_positions=positions,
        position_kind="sinusoidal" if marian else "learned",
        position_offset=0 if marian else 2,
        embed_scale=math.sqrt(hidden) if hf.get("scale_embedding") else 1.0,
        pre_norm=mbart,
        embedding_norm=not marian,
        final_norm=mbart,
    )


@dataclass(frozen=True, slots=True, eq=False)
class BartEncoderBlock:
    """An encoder layer's weights: LayerNorm scales [C] and projections as [out, in] views of
    [in, out] buffers, each with its bias (norm shifts [C]); Q, K and V as one fused product."""

    attn_norm: torch.Tensor
    attn_norm_bias: torch.Tensor
    qkv: FusedProjection
    o: Weight
    o_bias: torch.Tensor
    mlp_norm: torch.Tensor
    mlp_norm_bias: torch.Tensor
    up: Weight
    up_bias: torch.Tensor
    down: Weight
    down_bias: torch.Tensor


@dataclass(frozen=True, slots=True, eq=False)
class BartDecoderBlock(BartEncoderBlock):
    """A decoder layer: the encoder layer's weights plus its cross-attention's."""

    cross_norm: torch.Tensor
    cross_norm_bias: torch.Tensor
    cross_q: Weight
    cross_q_bias: torch.Tensor
    cross_kv: FusedProjection  # of the encoder output, once per source
    cross_o: Weight
    cross_o_bias: torch.Tensor


BlockT = TypeVar("BlockT", bound=BartEncoderBlock)


@dataclass(frozen=True, slots=True, eq=False)
class BartStack(Generic[BlockT]):
    """One stack: its layers, its position table [P, C] (learned or sinusoidal), and its embedding
    and final LayerNorms as (weight, bias) pairs, None where the variant has none."""

    layers: list[BlockT]
    positions: torch.Tensor
    embed_norm: tuple[torch.Tensor, torch.Tensor] | None
    norm: tuple[torch.Tensor, torch.Tensor] | None


class BartModel(ModelBase):
    """Encoder-decoder over canonical weights: ``encode`` / ``cross_kv`` / ``decode``."""

    def __init__(self, config: EncoderDecoderConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"activation {config.hidden_act!r} is not supported")
        check_tied(weights, ("encoder_embed.weight", "decoder_embed.weight"), config.architecture)
        self.config = config
        self.embed = weights["embed.weight"]  # [V, C]
        self.lm_head = weights["lm_head.weight"].t()  # [C, V] buffer seen as [V, C] for linear
        bias = weights.get("final_logits_bias")
        self.logits_bias = None if bias is None else bias.reshape(-1)  # [1, V] -> [V]
        if config.position_kind == "sinusoidal":
            table = sinusoidal_table(config.max_position_embeddings, config.hidden_size, self.embed.dtype,
                                     self.embed.device)
            pos_tables = {"encoder": table, "decoder": table}
        else:
            pos_tables = {stack: weights[f"{stack}.pos_embed.weight"] for stack in ("encoder", "decoder")}
        self.encoder = self._stack(weights, "encoder", config.num_encoder_layers, BartEncoderBlock, pos_tables)
        self.decoder = self._stack(weights, "decoder", config.num_layers, BartDecoderBlock, pos_tables)
        self.scale = config.head_dim**-0.5
        self.fused_layers = None  # one-op decoder layers for pure decode steps (whisper_decode.py)

    @staticmethod
    def _stack(weights, stack: str, num_layers: int, block: type[BlockT], pos_tables) -> BartStack[BlockT]:
        def pair(prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
            weight = weights.get(f"{prefix}.weight")
            return None if weight is None else (weight, weights[f"{prefix}.bias"])

        layers = []
        for i in range(num_layers):
            prefix = f"{stack}.layers.{i}"
            layer = {}
            for name in (field.name for field in fields(block) if not field.name.endswith("_bias")):
                if name in _FUSED:  # products of one input: one matrix (layers/fused.py)
                    layer[name] = fuse_projections(weights, [f"{prefix}.{part}" for part in _FUSED[name]])
                    continue
                weight = weights[f"{prefix}.{name}.weight"]
                # [in, out] buffers seen as [out, in]: linear then runs x @ buffer (the fast layout)
                layer[name] = weight if name.endswith("norm") else weight.t()
                layer[f"{name}_bias"] = weights[f"{prefix}.{name}.bias"]
            layers.append(block(**layer))
        return BartStack(layers=layers, positions=pos_tables[stack], embed_norm=pair(f"{stack}.embed_norm"),
                         norm=pair(f"{stack}.norm"))

    # -- the three entry points the engine uses ---------------------------------------------------
    @on_one_thread
    def encode(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *,
               products: Products) -> torch.Tensor:
        """Source tokens [B, S], positions [B or 1, S], valid [B, S] -> encoder output [B, S, C]
        (``products``: prompt rows, the thread budget)."""
        cfg, p = self.config, products
        x = self._embed(self.encoder, tokens, positions)
        mask = padding_bias(valid, x.dtype)  # [B, 1, 1, S] or None
        H, D = cfg.num_encoder_heads, cfg.hidden_size // cfg.num_encoder_heads
        for layer in self.encoder.layers:
            x = self._residual(x, layer.attn_norm, layer.attn_norm_bias,
                               lambda h: self._self_attention(h, layer, H, D, mask, p))
            x = self._residual(x, layer.mlp_norm, layer.mlp_norm_bias, lambda h: self._mlp(h, layer, p))
        return self._final_norm(self.encoder, x)

    def cross_kv(self, index: int, memory: torch.Tensor, p: Products) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``index``'s cross-attention K, V [B, H, S, D] of the encoder output [B, S, C]."""
        layer = self.decoder.layers[index]
        H, D = self.config.num_heads, self.config.head_dim
        k, v = layer.cross_kv.split(memory, p)  # [B, S, C] each
        return split_heads(k, H, D), split_heads(v, H, D)

    @on_one_thread
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        view: CacheView,
        cross: CrossStep | EncodedSources,
        all_logits: bool = False,
        logits_at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Target tokens, positions [B, T] -> logits [B, T or 1, V] ([B, K, V] at ``logits_at`` [K]).

        ``view`` (cache/view.py): an engine step plan (engine/plan.py) over flat tokens [1, N] of many
        sequences, which writes each token's K/V to its sequence's slots and builds its own masks; or
        the naive reference's ``NoCache`` over these tokens only, its mask ``decoder_self_bias`` (the
        additive causal mask [1, 1, T, T]). ``cross``: the step's view of each row's source K/V
        (engine/cross.py).
        """
        p = view.products  # the rows' roles and thread budget (layers/products.py)
        x = self._embed(self.decoder, tokens, positions)
        fused = self.fused_layers.step(view, cross, x) if self.fused_layers is not None else None
        layers = self.decoder.layers
        if fused is not None and (out := fused.every_layer(x)) is not None:  # every layer as one op, the same bits
            x, layers = out, []
        for index, layer in enumerate(layers):
            if fused is not None and (out := fused(index, x)) is not None:  # the layer as one op, the same bits
                x = out
                continue
            x = self._residual(x, layer.attn_norm, layer.attn_norm_bias,
                               lambda h: self._target_self_attention(h, layer, index, view, p))
            x = self._residual(x, layer.cross_norm, layer.cross_norm_bias,
                               lambda h: self._cross_attention(h, layer, index, cross, p))
            x = self._residual(x, layer.mlp_norm, layer.mlp_norm_bias, lambda h: self._mlp(h, layer, p))
        x = self.output_rows(x, all_logits, logits_at)
        x = self._final_norm(self.decoder, x)
        return linear(x, self.lm_head, self.logits_bias, products=p)  # [B, T or 1, V]

    def decoder_self_bias(self, length: int) -> torch.Tensor:
        """Causal mask [1, 1, P, P] for target slots 0..P-1: a slot sees itself and earlier slots."""
        mask = torch.full((length, length), float("-inf"), dtype=self.dtype, device=self.device).triu(1)
        return mask[None, None]  # [1, 1, P, P]

    # -- pieces ----------------------------------------------------------------------------------
    def _embed(self, stack: BartStack, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x = embed(tokens, self.embed).to(self.dtype)  # [B, T, C] (a float16-held embedding widened: whisper.py)
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
        x = x + F.embedding(positions + cfg.position_offset, stack.positions)  # [B or 1, T, C] broadcasts
        if stack.embed_norm is not None:
            x = F.layer_norm(x, (cfg.hidden_size,), *stack.embed_norm, cfg.norm_eps)
        return x

    def _residual(self, x: torch.Tensor, norm_w: torch.Tensor, norm_b: torch.Tensor, sublayer) -> torch.Tensor:
        """Pre-LN (mBART): x + f(LN(x)). Post-LN (BART, Marian): LN(x + f(x))."""
        C, eps = self.config.hidden_size, self.config.norm_eps
        if self.config.pre_norm:
            return x + sublayer(F.layer_norm(x, (C,), norm_w, norm_b, eps))
        return F.layer_norm(x + sublayer(x), (C,), norm_w, norm_b, eps)

    def _final_norm(self, stack: BartStack, x: torch.Tensor) -> torch.Tensor:
        if stack.norm is None:
            return x
        return F.layer_norm(x, (self.config.hidden_size,), *stack.norm, self.config.norm_eps)

    def _self_attention(self, h, layer, H: int, D: int, mask, p: Products) -> torch.Tensor:
        q, k, v = (split_heads(x, H, D) for x in layer.qkv.split(h, p))  # [B, H, T, D] each
        o = attention(q, k, v, mask, D**-0.5, threads=p.threads)  # [B, H, T, D]
        return linear(merge_heads(o), layer.o, layer.o_bias, products=p)

    def _target_self_attention(self, h, layer, index: int, view: CacheView, p: Products) -> torch.Tensor:
        H, D = self.config.num_heads, self.config.head_dim
        q, k, v = (split_heads(x, H, D) for x in layer.qkv.split(h, p))  # [B, H, T, D] each
        o = view.attend(index, q, k, v, self.scale)  # [B, H, T, D]: each sequence's own keys, the view's masks
        return linear(merge_heads(o), layer.o, layer.o_bias, products=p)

    def _cross_attention(self, h, layer, index: int, cross, p: Products) -> torch.Tensor:
        H, D = self.config.num_heads, self.config.head_dim
        q = split_heads(linear(h, layer.cross_q, layer.cross_q_bias, products=p), H, D)  # [B, H, T, D]
        o = cross.attend(index, q, self.scale, p.threads)  # [B, H, T, D] against K/V projected once per source
        return linear(merge_heads(o), layer.cross_o, layer.cross_o_bias, products=p)

    def _mlp(self, h: torch.Tensor, layer, p: Products) -> torch.Tensor:
        up = linear(h, layer.up, layer.up_bias, activation=self.config.hidden_act, products=p)
        return linear(up, layer.down, layer.down_bias, products=p)
