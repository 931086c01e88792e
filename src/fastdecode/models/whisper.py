"""Whisper: a speech encoder in front of an mBART-like decoder.

Encoder: log-mel features [B, M, 3000] -> conv1d (k=3, pad 1) + GELU -> conv1d (k=3, stride 2,
pad 1) + GELU -> [B, 1500, C] plus a sinusoidal position table (stored in both checkpoint formats),
pre-LN layers (no bias on K), a final LayerNorm. Decoder: token embedding plus learned positions
(448), pre-LN layers with cross-attention, a final LayerNorm, the output tied to the embedding.

The decoder is ``BartModel``'s (pre-norm, final norm, no embedding norm or scale); only the
encoder differs, so the engine's encoder-decoder machinery (cross K/V once per source, FastSeq
beam folding, engine/cross.py) runs it unchanged. Two checkpoint layouts map onto the same
canonical weights: a Hugging Face ``WhisperForConditionalGeneration`` folder (safetensors) and a
CTranslate2 ``WhisperSpec`` folder (``model.bin``, loading/ctranslate2_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.nn.functional as F

from ..config import EncoderDecoderConfig, derived_head_dim
from ..errors import CheckpointError, UnsupportedModelError
from ..layers.gemm import activated
from ..layers.linear import embed, float_kernel_serves
from ..layers.products import KernelChoice, Products
from ..layers.threads import on_one_thread, threads_for
from .bart import _DECODER_LAYER, _ENCODER_LAYER, BartModel
from .whisper_decode import FusedCrossDecode
from .base import token_id_list

N_FRAMES = 3000  # 30 s of 10 ms feature frames: the encoder's fixed input length
TOKEN_ROWS_KEPT = 4096  # decoder embedding rows a model keeps widened (base: 8 MB at most)


@dataclass
class WhisperConfig(EncoderDecoderConfig):
    source_kind: ClassVar[str] = "audio"  # the engine takes encoded windows (engine/speech_source.py)
    num_mel_bins: int = 80


# HF sublayer names: BART's (bart.py)
# Projections stored [out, in] in both formats; the canonical layout is [in, out].
_LINEARS = ("q", "k", "v", "o", "up", "down", "cross_q", "cross_k", "cross_v", "cross_o")
_NO_BIAS = ("k", "cross_k")  # Whisper's key projections have no bias


def hf_names(config: WhisperConfig) -> dict[str, str]:
    """Canonical name -> HF safetensors name (the tied ``proj_out`` is not read)."""
    names = {"embed.weight": "model.decoder.embed_tokens.weight",
             "decoder.pos_embed.weight": "model.decoder.embed_positions.weight",
             "encoder.pos_embed.weight": "model.encoder.embed_positions.weight"}
    for stack in ("encoder", "decoder"):
        names.update({f"{stack}.norm.{kind}": f"model.{stack}.layer_norm.{kind}" for kind in ("weight", "bias")})
    for conv in ("conv1", "conv2"):
        names.update({f"encoder.{conv}.{kind}": f"model.encoder.{conv}.{kind}" for kind in ("weight", "bias")})
    for stack, count, layer_names in (("encoder", config.num_encoder_layers, _ENCODER_LAYER),
                                      ("decoder", config.num_layers, _DECODER_LAYER)):
        for i in range(count):
            for name, hf in layer_names.items():
                for kind in ("weight", "bias"):
                    if kind == "bias" and name in _NO_BIAS:
                        continue
                    names[f"{stack}.layers.{i}.{name}.{kind}"] = f"model.{stack}.layers.{i}.{hf}.{kind}"
    return names


def config_from_hf(hf: dict[str, Any]) -> WhisperConfig:
    if hf.get("model_type", "whisper") != "whisper":
        raise UnsupportedModelError(f"model_type {hf.get('model_type')!r} is not Whisper")
    try:
        return _config(
            architecture=(hf.get("architectures") or ["WhisperForConditionalGeneration"])[0],
            vocab=hf["vocab_size"], hidden=hf["d_model"], mels=hf.get("num_mel_bins", 80),
            encoder_layers=hf["encoder_layers"], encoder_heads=hf["encoder_attention_heads"],
            encoder_ffn=hf["encoder_ffn_dim"], decoder_layers=hf["decoder_layers"],
            decoder_heads=hf["decoder_attention_heads"], decoder_ffn=hf["decoder_ffn_dim"],
            source_positions=hf.get("max_source_positions", 1500), target_positions=hf.get("max_target_positions", 448),
            activation=hf.get("activation_function", "gelu"),
            eos=token_id_list(hf.get("eos_token_id", 50256)), start=hf.get("decoder_start_token_id", 50257),
            pad=hf.get("pad_token_id"))
    except KeyError as exc:
        raise CheckpointError(f"Whisper config.json lacks {exc.args[0]!r}") from exc


def _config(*, architecture, vocab, hidden, mels, encoder_layers, encoder_heads, encoder_ffn, decoder_layers,
            decoder_heads, decoder_ffn, source_positions, target_positions, activation, eos, start, pad
            ) -> WhisperConfig:
    if activation != "gelu":
        raise UnsupportedModelError(f"Whisper with activation {activation!r} is not supported (only gelu)")
    return WhisperConfig(
        family="whisper", architecture=architecture, vocab_size=vocab, hidden_size=hidden,
        num_layers=decoder_layers, num_heads=decoder_heads, num_kv_heads=decoder_heads,
        head_dim=derived_head_dim(hidden, decoder_heads, ("d_model", "decoder_attention_heads")),
        intermediate_size=decoder_ffn, max_position_embeddings=target_positions, norm_eps=1e-5,
        hidden_act="gelu", tie_word_embeddings=True, attention_bias=True, attention_out_bias=True, mlp_bias=True,
        bos_token_id=start, eos_token_ids=eos, pad_token_id=pad, num_encoder_layers=encoder_layers,
        num_encoder_heads=encoder_heads, encoder_intermediate_size=encoder_ffn, decoder_start_token_id=start,
        max_source_positions=source_positions, max_target_positions=target_positions, position_kind="learned",
        position_offset=0, embed_scale=1.0, pre_norm=True, embedding_norm=False, final_norm=True,
        num_mel_bins=mels)


# -- CTranslate2's WhisperSpec ------------------------------------------------------------------
def config_from_ctranslate2(shape: Callable[[str], tuple[int, ...]], scalar: Callable[[str], int],
                            layer_counts: tuple[int, int], eos: int, start: int) -> WhisperConfig:
    """Dimensions from the tensors' shapes (CTranslate2 stores no model config for Whisper)."""
    vocab, hidden = shape("decoder/embeddings/weight")
    return _config(
        architecture="WhisperSpec", vocab=vocab, hidden=hidden, mels=shape("encoder/conv1/weight")[1],
        encoder_layers=layer_counts[0], encoder_heads=scalar("encoder/num_heads"),
        encoder_ffn=shape("encoder/layer_0/ffn/linear_0/weight")[0], decoder_layers=layer_counts[1],
        decoder_heads=scalar("decoder/num_heads"), decoder_ffn=shape("decoder/layer_0/ffn/linear_0/weight")[0],
        source_positions=shape("encoder/position_encodings/encodings")[0],
        target_positions=shape("decoder/position_encodings/encodings")[0], activation="gelu", eos=[eos],
        start=start, pad=eos)


def ctranslate2_weights(config: WhisperConfig, fetch: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor in the HF layout, from CTranslate2 variable names (fused QKV and
    cross KV split back; CTranslate2 stores zeros for the bias-free key projections)."""
    out = {"embed.weight": fetch("decoder/embeddings/weight"),
           "encoder.pos_embed.weight": fetch("encoder/position_encodings/encodings"),
           "decoder.pos_embed.weight": fetch("decoder/position_encodings/encodings")}
    for kind, ct2 in (("weight", "gamma"), ("bias", "beta")):
        for stack in ("encoder", "decoder"):
            out[f"{stack}.norm.{kind}"] = fetch(f"{stack}/layer_norm/{ct2}")
        for conv in ("conv1", "conv2"):
            out[f"encoder.{conv}.{kind}"] = fetch(f"encoder/{conv}/{kind}")

    def linear(prefix: str, ct2: str, parts: tuple[str, ...]) -> None:
        weight, bias = fetch(f"{ct2}/weight"), fetch(f"{ct2}/bias")  # [n*out, in], [n*out]: n equal parts
        for name, w, b in zip(parts, weight.chunk(len(parts)), bias.chunk(len(parts))):
            out[f"{prefix}.{name}.weight"] = w
            if name not in _NO_BIAS:
                out[f"{prefix}.{name}.bias"] = b

    def norm(prefix: str, name: str, ct2: str) -> None:
        out[f"{prefix}.{name}.weight"] = fetch(f"{ct2}/gamma")
        out[f"{prefix}.{name}.bias"] = fetch(f"{ct2}/beta")

    for stack, count in (("encoder", config.num_encoder_layers), ("decoder", config.num_layers)):
        for i in range(count):
            prefix, ct2 = f"{stack}.layers.{i}", f"{stack}/layer_{i}"
            norm(prefix, "attn_norm", f"{ct2}/self_attention/layer_norm")
            linear(prefix, f"{ct2}/self_attention/linear_0", ("q", "k", "v"))
            linear(prefix, f"{ct2}/self_attention/linear_1", ("o",))
            norm(prefix, "mlp_norm", f"{ct2}/ffn/layer_norm")
            linear(prefix, f"{ct2}/ffn/linear_0", ("up",))
            linear(prefix, f"{ct2}/ffn/linear_1", ("down",))
            if stack == "decoder":
                norm(prefix, "cross_norm", f"{ct2}/attention/layer_norm")
                linear(prefix, f"{ct2}/attention/linear_0", ("cross_q",))
                linear(prefix, f"{ct2}/attention/linear_1", ("cross_k", "cross_v"))
                linear(prefix, f"{ct2}/attention/linear_2", ("cross_o",))
    return out


def expected_shapes(config: WhisperConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape in the HF layout ([out, in] projections)."""
    C, M = config.hidden_size, config.num_mel_bins
    shapes = {"embed.weight": (config.vocab_size, C),
              "encoder.pos_embed.weight": (config.max_source_positions, C),
              "decoder.pos_embed.weight": (config.max_target_positions, C),
              "encoder.conv1.weight": (C, M, 3), "encoder.conv1.bias": (C,),
              "encoder.conv2.weight": (C, C, 3), "encoder.conv2.bias": (C,)}
    for stack, count, names, ffn in (("encoder", config.num_encoder_layers, _ENCODER_LAYER,
                                      config.encoder_intermediate_size),
                                     ("decoder", config.num_layers, _DECODER_LAYER, config.intermediate_size)):
        shapes.update({f"{stack}.norm.weight": (C,), f"{stack}.norm.bias": (C,)})
        for i in range(count):
            for name in names:
                weight = (C,) if name.endswith("norm") else {"up": (ffn, C), "down": (C, ffn)}.get(name, (C, C))
                shapes[f"{stack}.layers.{i}.{name}.weight"] = weight
                if name not in _NO_BIAS:
                    shapes[f"{stack}.layers.{i}.{name}.bias"] = weight[:1]
    return shapes


def canonical(config: WhisperConfig, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """HF-layout tensors (float32, owned) -> the canonical layout the model reads: [in, out]
    projections, the tied head as [C, V] with the embedding its transposed view. Shapes checked."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"{source} lacks {len(missing)} Whisper weight(s), e.g. {', '.join(missing[:5])}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise CheckpointError(f"{source}: {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    weights = {}
    for name in expected:
        tensor = tensors[name]
        is_linear = name.endswith(".weight") and name.split(".")[-2] in _LINEARS
        weights[name] = tensor.t().contiguous() if is_linear else tensor.contiguous()
    weights["lm_head.weight"] = weights["embed.weight"].t().contiguous()  # [C, V]
    weights["embed.weight"] = weights["lm_head.weight"].t()  # [V, C] view of the same memory
    return weights


# The decoder's products of every decode step: each row of a step streams these matrices (and the logits
# layer's), so a float32 model whose values are float16 values keeps them in float16 (``hold_in_half``).
_STEP_PRODUCTS = ("q", "k", "v", "o", "cross_q", "cross_o", "up", "down")


def hold_in_half(config: WhisperConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice) -> list[str]:
    """Hold the decoder's step products and the tied logits layer in float16 where that loses nothing
    (every value a float16 value: a CTranslate2 float16 checkpoint read as float32) and the float32
    kernel runs them (layers/linear.py: generated rows widen each weight as they load it, prompt rows
    take the GEMM on the float32 values, so every product keeps the float32 model's bits). A decode step
    then streams half the bytes: base's 48M decoder and logits weights are 97 MB instead of 194.
    ``weights`` (canonical, float32) is updated in place; returns the names held in half."""
    names = ["lm_head.weight"] + [f"decoder.layers.{i}.{name}.weight" for i in range(config.num_layers)
                                  for name in _STEP_PRODUCTS]
    held = []
    for name in names:
        weight = weights[name]  # [in, out] (the logits layer [C, V])
        if (not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32  # (quantized: as it is)
                or not float_kernel_serves(weight.t(), kernels)):
            continue
        half = weight.half()
        if torch.equal(half.float(), weight):  # exact (a value outside float16's range or precision: kept)
            weights[name] = half
            held.append(name)
    if "lm_head.weight" in held:
        weights["embed.weight"] = weights["lm_head.weight"].t()  # [V, C] view of the same memory
    return held


class WhisperModel(BartModel):
    """``BartModel``'s decoder (``cross_kv``, ``decode``) behind Whisper's convolutional encoder."""

    def __init__(self, config: WhisperConfig, weights: dict[str, torch.Tensor], kernels: KernelChoice,
                 cross_dtype: torch.dtype | None = None):
        """``cross_dtype``: how the cross K/V of a window are stored (default: the model's dtype);
        float16 halves what every decode step streams (4 x 4.6 MB per step on tiny.en in float32),
        the attention still computed in float32 (layers/cross_attention.cpp)."""
        self.half_held = hold_in_half(config, weights, kernels)
        super().__init__(config, weights, kernels)
        self.conv1 = (weights["encoder.conv1.weight"], weights["encoder.conv1.bias"])  # [C, M, 3], [C]
        self.conv2 = (weights["encoder.conv2.weight"], weights["encoder.conv2.bias"])  # [C, C, 3], [C]
        self.cross_dtype = cross_dtype or self.dtype
        self._token_rows: dict[int, torch.Tensor] = {}  # token id -> its embedding row [C] in the model's dtype
        self.fused_layers = FusedCrossDecode.for_model(self)  # pure decode steps: one op per layer; where it
        # runs, beams do not fold (engine/beam_group.py's folds_beams: a folded step would leave it)

    @property
    def dtype(self) -> torch.dtype:
        """The model's compute dtype (the position tables'; the embedding may be held in float16,
        ``hold_in_half``)."""
        return self.encoder.positions.dtype

    def cross_kv(self, index: int, memory: torch.Tensor, p: Products) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layer ``index``'s cross K, V [B, H, S, D] in ``cross_dtype``."""
        k, v = super().cross_kv(index, memory, p)
        if k.dtype == self.cross_dtype:
            return k, v
        return k.to(self.cross_dtype), v.to(self.cross_dtype)

    def _embed(self, stack, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``BartModel._embed`` (Whisper has no embedding scale or norm), the decoder's token rows taken
        from a cache of widened rows. The tied table is the logits layer's buffer: an int8 one decodes
        each row looked up, a float16-held one gathers C values a vocabulary apart and widens them, some
        0.15 ms of a 3.5 ms tiny.en int8 step. The same values: a row is decoded or widened alone."""
        if stack is not self.decoder:
            return super()._embed(stack, tokens, positions)
        rows = self._token_rows
        ids = tokens.reshape(-1).tolist()
        missing = [i for i in dict.fromkeys(ids) if i not in rows]
        if missing:
            if len(rows) + len(missing) > TOKEN_ROWS_KEPT:
                rows.clear()
            looked_up = embed(torch.tensor(missing, device=tokens.device), self.embed).to(self.dtype)  # [n, C]
            rows.update(zip(missing, looked_up.unbind(0)))
        x = torch.stack([rows[i] for i in ids]).view(*tokens.shape, -1)  # [B, T, C]
        return x + F.embedding(positions + self.config.position_offset, stack.positions)  # [B or 1, T, C]

    def encode(self, features: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Log-mel features [B, M, 3000] -> encoder output [B, 1500, C], on the caller's threads. Its
        rows are prompt rows: float32 weights take the GEMM (1500 rows: oneDNN's is ~3x the fixed-order
        decode kernel), int8 weights the int8 kernel as every other row (``int8_prompt_rows``, as
        CTranslate2's int8)."""
        cfg = self.config
        if features.dim() != 3 or features.shape[1] != cfg.num_mel_bins or features.shape[2] != 2 * cfg.max_source_positions:
            raise ValueError(f"Whisper features must be [batch, {cfg.num_mel_bins}, {2 * cfg.max_source_positions}], "
                             f"got {list(features.shape)}")
        return self._encode(features, Products.prompt(torch.get_num_threads(), kernels=self.kernels))

    @on_one_thread
    def _encode(self, features: torch.Tensor, p: Products) -> torch.Tensor:
        """The encoder's body on one torch thread: the convolutions, products, attention and GELUs (every
        one large) get ``p.threads`` back explicitly, the LayerNorms, residual adds and head merges (a
        fraction of a millisecond each) stay on one. Each of those was an OpenMP region of its own: with
        the second core busy elsewhere every region waited for it, and tiny.en's encoder took 1.0 s per
        window on two threads against 0.55 s on one (load ~2.5). The same bits: no op's result depends on
        its thread count, and the large ones keep theirs."""
        cfg = self.config
        x = activated(self._conv(features.to(self.dtype), self.conv1, 1, p), "gelu", p.threads)  # [B, C, 3000]
        x = activated(self._conv(x, self.conv2, 2, p), "gelu", p.threads)  # [B, C, 1500]
        x = x.transpose(1, 2) + self.encoder.positions  # [B, 1500, C]
        H = cfg.num_encoder_heads
        D = cfg.hidden_size // H
        for layer in self.encoder.layers:
            x = self._residual(x, layer.attn_norm, layer.attn_norm_bias,
                               lambda h: self._self_attention(h, layer, H, D, None, p))
            x = self._residual(x, layer.mlp_norm, layer.mlp_norm_bias, lambda h: self._mlp(h, layer, p))
        return self._final_norm(self.encoder, x)

    @staticmethod
    def _conv(x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor], stride: int,
              p: Products) -> torch.Tensor:
        """conv1d (kernel 3, padding 1) of x [B, M, T] -> [B, C, T / stride] on up to ``p.threads``."""
        weight = weight_bias[0]  # [C, M, 3]
        with threads_for(x.shape[0] * weight.numel() * x.shape[2] // stride, p.threads):  # multiply-adds
            return F.conv1d(x, *weight_bias, stride=stride, padding=1)
