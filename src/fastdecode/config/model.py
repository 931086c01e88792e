"""``ModelConfig``: the canonical description of a model, whatever format it came from, checked
once at load (``validate``); ``EncoderDecoderConfig`` adds the encoder's fields and family flags."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import UnsupportedModelError
from ..validation import is_int, is_number

FULL, SLIDING = "full_attention", "sliding_attention"  # the attention kinds of ``ModelConfig.layer_types``


@dataclass
class ModelConfig:
    """Canonical description of a decoder-only model, whatever format it came from."""

    is_encoder_decoder: ClassVar[bool] = False
    position_kinds: ClassVar[tuple[str, ...]] = ("rope", "alibi", "learned")  # the schemes position_kind names

    family: str  # registry key: "llama" (llama, mistral, qwen2, smollm2) or "gpt2"
    architecture: str  # the name the checkpoint used (e.g. "MistralForCausalLM", "llama")
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (qwen2: True)
    attention_out_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    # Attention kind of each layer: "full_attention" (every earlier token) or "sliding_attention"
    # (the last ``sliding_window`` positions). Empty: every layer is sliding when ``sliding_window``
    # is set (Mistral), else full. The window belongs to the layer: every strategy's mask takes it
    # from here (models/attention_kinds via ``layer_windows``), never from the engine.
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3: 10,000); None: as full layers
    attention_scale: float | None = None  # query scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2/3 option)
    # RMSNorm on queries and keys before RoPE: "head" over each head's D (Qwen3), "projection" over
    # the whole projection, H*D or Hkv*D (OLMo 2); None: none
    qk_norm: str | None = None
    nope_layers: list[int] = field(default_factory=list)  # layers that do not rotate q and k (SmolLM3)
    embedding_multiplier: float = 1.0  # Granite: token embeddings times this
    residual_multiplier: float = 1.0  # Granite: each block's attention and MLP outputs times this
    logits_divisor: float = 1.0  # Granite's logits_scaling: logits divided by this
    attention_softcapping: float | None = None  # scores = cap * tanh(scores / cap) before the mask (Gemma 2)
    position_kind: str = "rope"  # "rope", "alibi" or "learned" (absolute, cannot be shifted)
    residual_after_norm: bool = False  # BLOOM's apply_residual_connection_post_layernorm
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            return  # a bad layer count is the loader's validation error, not this one's
        if not self.layer_types:
            kind = SLIDING if self.sliding_window is not None else FULL
            self.layer_types = [kind] * self.num_layers
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_layers:
            raise UnsupportedModelError(
                f"layer_types names {len(self.layer_types)} layers but the model has {self.num_layers}")
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise UnsupportedModelError(
                f"unsupported attention layer type(s) {', '.join(map(repr, unknown))}; supported: {SLIDING!r}, {FULL!r}")
        if any(not isinstance(i, int) or not 0 <= i < self.num_layers for i in self.nope_layers):
            raise UnsupportedModelError(f"NoPE layer indices must lie in [0, {self.num_layers}), got {self.nope_layers!r}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise UnsupportedModelError("sliding_attention layers need a sliding_window, got None")

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's attention window in positions (None: full attention)."""
        return [self.sliding_window if kind == SLIDING else None for kind in self.layer_types]

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING in self.layer_types

    @property
    def attention_kind(self) -> str:
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def position_scheme(self) -> str:
        if self.position_kind == "rope":
            partial = f", {self.partial_rotary_factor:g} of head dims" if self.partial_rotary_factor != 1 else ""
            nope = f"; no rotation in layers {', '.join(map(str, self.nope_layers))}" if self.nope_layers else ""
            return f"rope (half-split{partial}){nope}"
        return {"alibi": "alibi", "learned": "learned absolute"}[self.position_kind]

    def kv_cache_bytes_per_token(self, bytes_per_element: int = 4) -> int:
        """K and V for every layer, only the KV heads the model has."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def kv_bytes_per_token_by_kind(self, bytes_per_element: int = 4) -> dict[str, int]:
        """K and V per token for the layers of each attention kind (sliding layers need them only
        for the last ``sliding_window`` tokens)."""
        per_layer = 2 * self.num_kv_heads * self.head_dim * bytes_per_element
        return {kind: per_layer * self.layer_types.count(kind) for kind in (FULL, SLIDING) if kind in self.layer_types}

    @property
    def layer_counts(self) -> dict[str, int]:
        """Blocks per placeholder of the weight-name templates (``{layer}``)."""
        return {"layer": self.num_layers}

    def validate(self, source: str = "the checkpoint") -> None:
        """Types, ranges and divisibility of the canonical fields; CheckpointError naming the field.

        Run by every loader before any weight is read, so a bad value never reaches a tensor op.
        """
        from ..errors import CheckpointError

        def fail(message: str) -> CheckpointError:
            return CheckpointError(f"config of {source}: {message}")

        for name in self._positive_ints():
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise fail(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise fail(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        for name in ("norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value < 0:
                raise fail(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_divisor"):
            value = getattr(self, name)
            if not is_number(value) or not math.isfinite(value) or value == 0:
                raise fail(f"{name} must be a finite non-zero number, got {value!r}")
        if self.qk_norm not in (None, "head", "projection"):
            raise fail(f"qk_norm must be 'head', 'projection' or None, got {self.qk_norm!r}")
        if self.position_kind == "rope" and not 0 < self.partial_rotary_factor <= 1:
            raise fail(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.position_kind not in self.position_kinds:
            kinds = ", ".join(self.position_kinds[:-1]) + " or " + self.position_kinds[-1]
            raise fail(f"position_kind must be {kinds}, got {self.position_kind!r}")
        if self.sliding_window is not None and (not is_int(self.sliding_window) or self.sliding_window < 1):
            raise fail(f"sliding_window must be an integer >= 1 when a sliding window is used, "
                       f"got {self.sliding_window!r}")
        if not isinstance(self.hidden_act, str) or not isinstance(self.architecture, str):
            raise fail(f"hidden_act and architecture must be strings, got {self.hidden_act!r}, {self.architecture!r}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not is_int(value):
                raise fail(f"{name} must be an integer or absent, got {value!r}")
        if not isinstance(self.eos_token_ids, list) or any(not is_int(t) or t < 0 for t in self.eos_token_ids):
            raise fail(f"eos_token_id must be a non-negative integer or a list of them, got {self.eos_token_ids!r}")

    def _positive_ints(self) -> tuple[str, ...]:
        return ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "max_position_embeddings")


@dataclass
class EncoderDecoderConfig(ModelConfig):
    """An encoder-decoder model (BART, mBART, Marian, T5).

    The inherited fields describe the decoder (``num_layers``, ``num_heads``, ``intermediate_size``
    are the decoder's; its self-attention cache is the KV cache). The encoder has its own depth,
    heads and FFN width. Family flags select the variant: ``position_kind`` ("learned", "sinusoidal" or
    "relative"), pre- or post-LN, embedding scale and norms (BART family); relative buckets, gated
    FFN and the output rescale (T5).
    """

    is_encoder_decoder: ClassVar[bool] = True
    source_kind: ClassVar[str] = "tokens"  # what a request's source is ("audio": an encoded speech window)
    position_kinds: ClassVar[tuple[str, ...]] = ("learned", "sinusoidal", "relative")

    num_encoder_layers: int = 0
    num_encoder_heads: int = 0
    encoder_intermediate_size: int = 0
    decoder_start_token_id: int = 0
    forced_bos_token_id: int | None = None
    forced_eos_token_id: list[int] = field(default_factory=list)
    max_source_positions: int | None = None  # None: relative positions, no hard limit
    max_target_positions: int | None = None
    position_kind: str = "learned"  # "learned" (+ position_offset), "sinusoidal" or "relative"
    position_offset: int = 0  # BART/mBART look position p up at row p + 2
    embed_scale: float = 1.0  # sqrt(d_model) with scale_embedding
    pre_norm: bool = False  # mBART (and T5): LayerNorm before each sublayer, not after
    embedding_norm: bool = False  # BART/mBART: LayerNorm right after the embeddings
    final_norm: bool = False  # mBART: LayerNorm at the end of encoder and decoder
    relative_buckets: int = 32
    relative_max_distance: int = 128
    gated_ffn: bool = False  # T5 v1.1 / flan-t5: act(x W0) * (x W1)
    scale_decoder_output: bool = False  # T5 with a tied head: hidden * d_model**-0.5 before the head

    def _positive_ints(self) -> tuple[str, ...]:
        return super()._positive_ints() + ("num_encoder_layers", "num_encoder_heads", "encoder_intermediate_size")

    def validate(self, source: str = "the checkpoint") -> None:
        from ..errors import CheckpointError

        super().validate(source)
        if self.position_kind != "relative" and self.hidden_size % self.num_encoder_heads:
            raise CheckpointError(f"config of {source}: num_encoder_heads ({self.num_encoder_heads}) must divide "
                                  f"hidden_size ({self.hidden_size})")

    @property
    def position_scheme(self) -> str:
        if self.position_kind == "learned":
            return f"learned absolute (offset {self.position_offset})"
        return "sinusoidal" if self.position_kind == "sinusoidal" else "relative buckets"

    def cross_cache_bytes_per_source_token(self, bytes_per_element: int = 4) -> int:
        """Cross-attention K and V for every decoder layer, per source token (stored once per source)."""
        return 2 * self.num_layers * self.num_heads * self.head_dim * bytes_per_element

    @property
    def layer_counts(self) -> dict[str, int]:
        return {"layer": self.num_layers, "encoder_layer": self.num_encoder_layers}


def derived_head_dim(hidden_size: Any, num_heads: Any,
                     names: tuple[str, str] = ("hidden_size", "num_attention_heads")) -> int:
    """hidden_size // num_heads, or a ValueError naming the config fields when that is not a whole
    positive number (a zero, a string, a float, heads that do not divide the width); the loaders
    turn it into a CheckpointError naming the checkpoint."""
    if not is_int(hidden_size) or hidden_size < 1:
        raise ValueError(f"{names[0]} must be an integer >= 1, got {hidden_size!r}")
    if not is_int(num_heads) or num_heads < 1:
        raise ValueError(f"{names[1]} must be an integer >= 1, got {num_heads!r}")
    if hidden_size % num_heads:
        raise ValueError(f"{names[1]} ({num_heads}) must divide {names[0]} ({hidden_size})")
    return hidden_size // num_heads
