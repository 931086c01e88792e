"""T5 v1.0, v1.1 and flan-t5: one encoder-decoder with config flags.

Pre-norm blocks with RMS LayerNorm (scale only, no bias, no mean), no biases anywhere, no
position embeddings: each stack's first layer owns a table of relative-position bucket biases
([buckets, H]) that every layer of that stack adds to its self-attention scores, unscaled
(T5 folds the 1/sqrt(d) into its initialisation). The encoder's buckets are bidirectional, the
decoder's causal; cross-attention has no position bias. The bias is computed once per call
(encoder) or once per generation (a decoder table sliced per step), never per layer.
Flags: ReLU FFN (v1.0) or gated GELU ``act(x W0) * (x W1)`` (v1.1, flan); tied head with the
``d_model**-0.5`` rescale of the decoder output (v1.0) or untied head, no rescale (v1.1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
import torch.nn.functional as F

from .base import ModelBase, Weight, token_id_list
from ..config import EncoderDecoderConfig
from ..errors import UnsupportedModelError
from ..layers.attention import attention, merge_heads, split_heads
from ..layers.linear import ACTIVATIONS, embed, linear
from ..layers.products import KernelChoice, Products
from ..cache.view import CacheView
from ..layers.threads import on_one_thread
from ..layers.positions import t5_relative_buckets
from .seq2seq import check_tied, decoder_start_token, padding_bias

if TYPE_CHECKING:  # the engine's views a decoder step attends through
    from ..engine.cross import CrossStep, EncodedSources

_ATTENTION = ("q", "k", "v", "o")
_FFN = ("wi", "wi_0", "wi_1", "wo")  # wi (v1.0) or wi_0 / wi_1 (gated), then wo


def _layer_names(stack: str, placeholder: str, decoder: bool) -> dict[str, str]:
    """Canonical -> HF names of one block: sublayer 0 self-attention, (1 cross-attention,) last the FFN."""
    block = f"{stack}.block.{{{placeholder}}}.layer"
    ffn = 2 if decoder else 1
    names = {"attn_norm.weight": f"{block}.0.layer_norm.weight",
             **{f"{p}.weight": f"{block}.0.SelfAttention.{p}.weight" for p in _ATTENTION},
             "mlp_norm.weight": f"{block}.{ffn}.layer_norm.weight",
             **{f"{p}.weight": f"{block}.{ffn}.DenseReluDense.{p}.weight" for p in _FFN}}
    if decoder:
        names["cross_norm.weight"] = f"{block}.1.layer_norm.weight"
        names.update({f"cross_{p}.weight": f"{block}.1.EncDecAttention.{p}.weight" for p in _ATTENTION})
    return {f"{stack}.layers.{{{placeholder}}}.{name}": hf for name, hf in names.items()}


HF_NAMES = {
    "embed.weight": "shared.weight",
    # transformers ties these to shared.weight (the same tensor in memory; saved folders drop them)
    "encoder_embed.weight": "encoder.embed_tokens.weight",
    "decoder_embed.weight": "decoder.embed_tokens.weight",
    "lm_head.weight": "lm_head.weight",
    "encoder.relative_bias.weight": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    "decoder.relative_bias.weight": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    "encoder.norm.weight": "encoder.final_layer_norm.weight",
    "decoder.norm.weight": "decoder.final_layer_norm.weight",
    **_layer_names("encoder", "encoder_layer", decoder=False),
    **_layer_names("decoder", "layer", decoder=True),
}
OUT_IN_WEIGHTS = ("q.weight", "k.weight", "v.weight", "o.weight", "wi.weight", "wi_0.weight", "wi_1.weight",
                  "wo.weight", "lm_head.weight")
# Some old checkpoints carry an unused relative bias on the first cross-attention (transformers ignores it).
IGNORED_NAME_PATTERNS = (r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",)


def weight_names(config: EncoderDecoderConfig) -> tuple[list[str], list[str]]:
    """(required, optional). An untied head (v1.1) missing from the checkpoint falls back to the
    embedding, as transformers 5 ties a missing head; a tied head (v1.0) is never required."""
    ffn = ["wi_0.weight", "wi_1.weight"] if config.gated_ffn else ["wi.weight"]
    per_layer = ["attn_norm.weight", *(f"{p}.weight" for p in _ATTENTION), "mlp_norm.weight", *ffn, "wo.weight"]
    cross = ["cross_norm.weight", *(f"cross_{p}.weight" for p in _ATTENTION)]
    required = ["embed.weight", "encoder.relative_bias.weight", "decoder.relative_bias.weight",
                "encoder.norm.weight", "decoder.norm.weight"]
    required += [f"encoder.layers.{{encoder_layer}}.{name}" for name in per_layer]
    required += [f"decoder.layers.{{layer}}.{name}" for name in per_layer + cross]
    optional = ["encoder_embed.weight", "decoder_embed.weight", "lm_head.weight"]
    return required, optional


def weight_shapes(config: EncoderDecoderConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the HF layout ([out, in] linear weights, no biases)."""
    C, V, F = config.hidden_size, config.vocab_size, config.intermediate_size
    inner = config.num_heads * config.head_dim
    attention = {"q.weight": (inner, C), "k.weight": (inner, C), "v.weight": (inner, C), "o.weight": (C, inner)}
    layer = {"attn_norm.weight": (C,), **attention, "mlp_norm.weight": (C,), "wi.weight": (F, C),
             "wi_0.weight": (F, C), "wi_1.weight": (F, C), "wo.weight": (C, F)}
    cross = {"cross_norm.weight": (C,), **{f"cross_{name}": shape for name, shape in attention.items()}}
    shapes = {"embed.weight": (V, C), "encoder_embed.weight": (V, C), "decoder_embed.weight": (V, C),
              "lm_head.weight": (V, C), "encoder.norm.weight": (C,), "decoder.norm.weight": (C,),
              "encoder.relative_bias.weight": (config.relative_buckets, config.num_encoder_heads),
              "decoder.relative_bias.weight": (config.relative_buckets, config.num_heads)}
    shapes.update({f"encoder.layers.{{encoder_layer}}.{name}": shape for name, shape in layer.items()})
    shapes.update({f"decoder.layers.{{layer}}.{name}": shape for name, shape in {**layer, **cross}.items()})
    return shapes


def config_from_hf(hf: dict[str, Any]) -> EncoderDecoderConfig:
    projection = hf.get("feed_forward_proj", "relu")
    parts = projection.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise UnsupportedModelError(f"T5 feed_forward_proj {projection!r} is not supported")
    activation = "gelu_new" if projection == "gated-gelu" else parts[-1]  # transformers' legacy alias
    heads, head_dim = hf["num_heads"], hf["d_kv"]
    encoder_layers = hf["num_layers"]
    # v1.0 ties the head and rescales by d_model**-0.5; v1.1 / flan (tie_word_embeddings=False in their
    # original configs; scale_decoder_outputs=False once saved by transformers 5) does neither.
    rescale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
    return EncoderDecoderConfig(
        family="t5",
        architecture=(hf.get("architectures") or ["t5"])[0],
        vocab_size=hf["vocab_size"],
        hidden_size=hf["d_model"],
        num_layers=hf.get("num_decoder_layers") or encoder_layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=hf["d_ff"],
        max_position_embeddings=hf.get("n_positions") or 512,  # the trained length; buckets extrapolate
        norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        hidden_act=activation,
        tie_word_embeddings=bool(rescale),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=token_id_list(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        num_encoder_layers=encoder_layers,
        num_encoder_heads=heads,
        encoder_intermediate_size=hf["d_ff"],
        decoder_start_token_id=decoder_start_token(hf),
        forced_bos_token_id=hf.get("forced_bos_token_id"),
        forced_eos_token_id=token_id_list(hf.get("forced_eos_token_id")),
        max_source_positions=None,  # relative positions: no table to run past
        max_target_positions=None,
        position_kind="relative",
        pre_norm=True,
        final_norm=True,
        relative_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_max_distance=hf.get("relative_attention_max_distance", 128),
        gated_ffn=len(parts) == 2,
        scale_decoder_output=bool(rescale),
    )


@dataclass(frozen=True, slots=True, eq=False)
class T5EncoderBlock:
    """An encoder layer's weights: RMS norm scales [C] and projections as [out, in] views of
    [in, out] buffers; the FFN has ``wi`` (v1.0) or ``wi_0`` and ``wi_1`` (gated), the others None."""

    attn_norm: torch.Tensor
    mlp_norm: torch.Tensor
    q: Weight
    k: Weight
    v: Weight
    o: Weight
    wi: Weight | None
    wi_0: Weight | None
    wi_1: Weight | None
    wo: Weight


@dataclass(frozen=True, slots=True, eq=False)
class T5DecoderBlock(T5EncoderBlock):
    """A decoder layer: the encoder layer's weights plus its cross-attention's."""

    cross_norm: torch.Tensor
    cross_q: Weight
    cross_k: Weight
    cross_v: Weight
    cross_o: Weight


BlockT = TypeVar("BlockT", bound=T5EncoderBlock)


@dataclass(frozen=True, slots=True, eq=False)
class T5Stack(Generic[BlockT]):
    """One stack: its layers, its relative-position bucket biases [buckets, H] and final norm scale [C]."""

    layers: list[BlockT]
    relative_bias: torch.Tensor
    norm: torch.Tensor


class T5Model(ModelBase):
    """Encoder-decoder over canonical weights: ``encode`` / ``cross_kv`` / ``decode``."""

    def __init__(self, config: EncoderDecoderConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice):
        self.kernels = kernels  # the kernel choice every forward's Products carry (set at load)
        if config.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"T5 activation {config.hidden_act!r} is not supported")
        check_tied(weights, ("encoder_embed.weight", "decoder_embed.weight"), config.architecture)
        self.config = config
        self.embed = weights["embed.weight"]  # [V, C]
        head = weights.get("lm_head.weight")
        self.tied_head = head is None or config.tie_word_embeddings
        # [C, V] buffer seen as [V, C] for linear; a missing untied head is the embedding itself
        self.lm_head = self.embed if head is None else head.t()
        self.encoder = self._stack(weights, "encoder", config.num_encoder_layers, T5EncoderBlock)
        self.decoder = self._stack(weights, "decoder", config.num_layers, T5DecoderBlock)

    def _stack(self, weights, stack: str, num_layers: int, block: type[BlockT]) -> T5Stack[BlockT]:
        layers = []
        for i in range(num_layers):
            layer = {}
            for name in (field.name for field in fields(block)):  # the block's weights, cross_* in a decoder
                weight = weights.get(f"{stack}.layers.{i}.{name}.weight")
                # [in, out] buffers seen as [out, in]: linear then runs x @ buffer (the fast layout)
                layer[name] = weight if weight is None or name.endswith("norm") else weight.t()
            layers.append(block(**layer))
        return T5Stack(layers=layers, relative_bias=weights[f"{stack}.relative_bias.weight"],  # [buckets, H]
                       norm=weights[f"{stack}.norm.weight"])

    # -- the three entry points the engine uses ---------------------------------------------------
    @on_one_thread
    def encode(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *,
               products: Products) -> torch.Tensor:
        """Source tokens [B, S], positions [B or 1, S], valid [B, S] -> encoder output [B, S, C]
        (``products``: prompt rows, the thread budget)."""
        p = products
        x = embed(tokens, self.embed)  # [B, S, C]
        bias = self._relative_bias(self.encoder.relative_bias, positions, positions, bidirectional=True)
        padding = padding_bias(valid, x.dtype)  # [B, 1, 1, S] or None
        if padding is not None:
            bias = bias + padding  # [B, H, S, S]
        for layer in self.encoder.layers:
            h = self._norm(x, layer.attn_norm)
            x = x + self._attention(h, h, layer.q, layer.k, layer.v, layer.o, bias, p)
            x = x + self._ffn(self._norm(x, layer.mlp_norm), layer, p)
        return self._norm(x, self.encoder.norm)

    def cross_kv(self, index: int, memory: torch.Tensor, p: Products) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``index``'s cross-attention K, V [B, H, S, D] of the encoder output [B, S, C]."""
        layer = self.decoder.layers[index]
        H, D = self.config.num_heads, self.config.head_dim
        k, v = linear(memory, layer.cross_k, products=p), linear(memory, layer.cross_v, products=p)  # [B, S, C]
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

        ``view`` (cache/view.py): an engine step plan over flat tokens [1, N] of many sequences, which
        writes their K/V to each sequence's slots and masks with ``decoder_position_bias``; or the naive
        reference's ``NoCache`` over these tokens only, its mask ``decoder_self_bias`` (relative bias
        plus causal mask [1, H, T, T]). ``cross``: each row's source K/V (engine/cross.py).
        """
        p = view.products  # the rows' roles and thread budget (layers/products.py)
        cfg = self.config
        H, D = cfg.num_heads, cfg.head_dim
        x = embed(tokens, self.embed)  # [B, T, C]
        for index, layer in enumerate(self.decoder.layers):
            h = self._norm(x, layer.attn_norm)
            q, k, v = (split_heads(linear(h, w, products=p), H, D) for w in (layer.q, layer.k, layer.v))  # [B, H, T, D]
            o = view.attend(index, q, k, v, 1.0)  # [B, H, T, D]
            x = x + linear(merge_heads(o), layer.o, products=p)
            h = self._norm(x, layer.cross_norm)
            q = split_heads(linear(h, layer.cross_q, products=p), H, D)  # [B, H, T, D]
            o = cross.attend(index, q, 1.0, p.threads)  # [B, H, T, D] against K/V projected once per source
            x = x + linear(merge_heads(o), layer.cross_o, products=p)
            x = x + self._ffn(self._norm(x, layer.mlp_norm), layer, p)
        x = self.output_rows(x, all_logits, logits_at)
        x = self._norm(x, self.decoder.norm)
        if cfg.scale_decoder_output:
            x = x * cfg.hidden_size**-0.5
        return linear(x, self.lm_head, products=p)  # [B, T or 1, V]

    def decoder_self_bias(self, length: int) -> torch.Tensor:
        """Relative bias plus causal mask [1, H, P, P] for target positions 0..P-1, built once per generation."""
        positions = torch.arange(length, device=self.device)[None]  # [1, P]
        bias = self._relative_bias(self.decoder.relative_bias, positions, positions, bidirectional=False)
        causal = torch.full((length, length), float("-inf"), dtype=bias.dtype, device=bias.device).triu(1)
        return bias + causal  # [1, H, P, P]

    # -- pieces ----------------------------------------------------------------------------------
    def _relative_bias(self, table: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                       bidirectional: bool) -> torch.Tensor:
        """[buckets, H] table, positions [B or 1, T] and [B or 1, S] -> additive bias [B or 1, H, T, S]."""
        relative = key_positions[:, None, :] - query_positions[:, :, None]  # [B, T, S]
        return self._bucket_bias(table, relative, bidirectional)

    def decoder_position_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """Key minus query positions [B, T, S] -> the decoder's relative bias [B, H, T, S] (an engine
        plan's ``score_bias``: the plan adds it to its own causal mask)."""
        return self._bucket_bias(self.decoder.relative_bias, distance, bidirectional=False)

    def _bucket_bias(self, table: torch.Tensor, relative: torch.Tensor, bidirectional: bool) -> torch.Tensor:
        cfg = self.config
        buckets = t5_relative_buckets(relative, bidirectional, cfg.relative_buckets, cfg.relative_max_distance)
        return F.embedding(buckets, table).permute(0, 3, 1, 2)  # [B, T, S, H] -> [B, H, T, S]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.config.hidden_size,), weight, self.config.norm_eps)

    def _attention(self, h, memory, wq, wk, wv, wo, bias, p: Products) -> torch.Tensor:
        H, D = self.config.num_heads, self.config.head_dim
        q = split_heads(linear(h, wq, products=p), H, D)  # [B, H, T, D]
        k = split_heads(linear(memory, wk, products=p), H, D)  # [B, H, S, D]
        v = split_heads(linear(memory, wv, products=p), H, D)
        return linear(merge_heads(attention(q, k, v, bias, 1.0, threads=p.threads)), wo, products=p)

    def _ffn(self, h: torch.Tensor, layer, p: Products) -> torch.Tensor:
        act = self.config.hidden_act
        if self.config.gated_ffn:
            gate = linear(h, layer.wi_0, activation=act, products=p)
            return linear(gate * linear(h, layer.wi_1, products=p), layer.wo, products=p)
        return linear(linear(h, layer.wi, activation=act, products=p), layer.wo, products=p)
