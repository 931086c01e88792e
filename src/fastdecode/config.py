"""Configurations: ``ModelConfig`` (canonical model fields) and ``GenerationConfig`` (options).

Option names follow Hugging Face ``generate()``; every option is validated here, once, so that
strategies can trust their inputs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import InvalidOptionError, UnsupportedModelError

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
            return f"rope (half-split{partial})"
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
        from .errors import CheckpointError

        def fail(message: str) -> CheckpointError:
            return CheckpointError(f"config of {source}: {message}")

        for name in self._positive_ints():
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise fail(f"{name} must be an integer >= 1, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise fail(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        for name in ("norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise fail(f"{name} must be a finite number >= 0, got {value!r}")
        if self.position_kind == "rope" and not 0 < self.partial_rotary_factor <= 1:
            raise fail(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor!r}")
        if self.position_kind not in self.position_kinds:
            kinds = ", ".join(self.position_kinds[:-1]) + " or " + self.position_kinds[-1]
            raise fail(f"position_kind must be {kinds}, got {self.position_kind!r}")
        if self.sliding_window is not None and (not _is_int(self.sliding_window) or self.sliding_window < 1):
            raise fail(f"sliding_window must be an integer >= 1 when a sliding window is used, "
                       f"got {self.sliding_window!r}")
        if not isinstance(self.hidden_act, str) or not isinstance(self.architecture, str):
            raise fail(f"hidden_act and architecture must be strings, got {self.hidden_act!r}, {self.architecture!r}")
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise fail(f"{name} must be an integer or absent, got {value!r}")
        if not isinstance(self.eos_token_ids, list) or any(not _is_int(t) or t < 0 for t in self.eos_token_ids):
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
        from .errors import CheckpointError

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


SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes 0 <= seed < 2**64
INT_OPTION_LIMIT = 1 << 62  # any integer option past this would overflow a tensor index first
INT_OPTIONS = ("max_new_tokens", "min_new_tokens", "top_k", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
               "num_beams", "num_return_sequences", "n_ctx", "n_keep", "n_discard")


@dataclass
class GenerationConfig:
    """Generation options with Hugging Face names. ``validate()`` raises InvalidOptionError."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0  # encoder-decoder only: never copy an n-gram of the source
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    eos_token_id: int | list[int] | None = None
    stop: str | list[str] | None = None
    seed: int | list[int] | None = None  # an int, or one per prompt (see generation/sampling.py)
    use_cache: bool = True
    # Memory a request may use, in bytes (or "8GB", "512MiB"...): checked before allocating.
    # None: the memory available now (MemAvailable, or free CUDA memory).
    max_memory: int | str | None = None
    # Streaming ("infinite") generation: a cache of n_ctx slots, n_keep attention sinks.
    n_ctx: int | None = None
    n_keep: int = 4
    n_discard: int | None = None  # default: 1 for shift (a true ring), half the window for reevaluate
    policy: str = "shift"  # "shift" (no recomputation) or "reevaluate"

    @classmethod
    def from_options(cls, base: "GenerationConfig | None" = None, **options: Any) -> "GenerationConfig":
        """Overlay keyword options on ``base`` (or the defaults); unknown names are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidOptionError(
                f"unknown generation option(s): {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
            )
        values = dataclasses.asdict(base) if base is not None else {}
        # None means "the default" except where None is itself a meaningful value.
        nullable = {f.name for f in dataclasses.fields(cls) if f.default is None} | {"max_new_tokens"}
        values.update({k: v for k, v in options.items() if v is not None or k in nullable})
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        def bad(message: str) -> InvalidOptionError:
            return InvalidOptionError(message)

        for name in INT_OPTIONS:
            value = getattr(self, name)
            if _is_int(value) and value > INT_OPTION_LIMIT:  # would overflow a tensor index long before
                raise bad(f"{name}={value} is absurdly large (the limit is 2**62)")
        if self.max_new_tokens is None:
            if self.n_ctx is None:
                raise bad("max_new_tokens=None (endless generation) needs a streaming cache: set n_ctx")
        elif not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be an integer >= 0 (or None with n_ctx), got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise bad(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise bad(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if not isinstance(self.do_sample, bool):
            raise bad(f"do_sample must be True or False, got {self.do_sample!r}")
        if not isinstance(self.use_cache, bool):
            raise bad(f"use_cache must be True or False, got {self.use_cache!r}")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 0):
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not _is_finite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise bad(f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")
        if not _is_int(self.encoder_no_repeat_ngram_size) or self.encoder_no_repeat_ngram_size < 0:
            raise bad("encoder_no_repeat_ngram_size must be an integer >= 0, "
                      f"got {self.encoder_no_repeat_ngram_size!r}")
        if not _is_int(self.num_beams) or self.num_beams < 1:
            raise bad(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not _is_int(self.num_return_sequences) or self.num_return_sequences < 1:
            raise bad(f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}")
        if self.num_beams > 1:
            self._validate_beams(bad)
        elif self.num_return_sequences > 1 and not self.do_sample:
            raise bad(
                "num_return_sequences > 1 needs do_sample=True or num_beams > 1 "
                "(greedy decoding would return identical copies)"
            )
        if self.early_stopping not in (True, False, "never"):
            raise bad(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, (int, list, tuple)):
            raise bad(f"eos_token_id must be a non-negative integer or a list of them, got {self.eos_token_id!r}")
        eos = self.eos_token_ids_or_none()
        if eos is not None and any(not _is_int(t) or not 0 <= t <= INT_OPTION_LIMIT for t in eos):
            raise bad(f"eos_token_id must be a non-negative integer or a list of them, got {self.eos_token_id!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        stops = self.stop_strings()
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        seeds = self.seed if isinstance(self.seed, list) else [] if self.seed is None else [self.seed]
        if any(not _is_int(s) or not 0 <= s < SEED_LIMIT for s in seeds) or (isinstance(self.seed, list) and not seeds):
            raise bad(f"seed must be an integer in [0, 2**64) (or a list of them, one per prompt), got {self.seed!r}")
        if self.max_memory is not None:
            from .memory import parse_size

            parse_size(self.max_memory)
        self._validate_streaming(bad)

    def _validate_beams(self, bad) -> None:
        if self.num_return_sequences > self.num_beams:
            raise bad(f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams})")
        if self.do_sample:
            raise bad("beam sampling (num_beams > 1 with do_sample=True) is not supported; use do_sample=False")
        if not _is_finite(self.length_penalty):
            raise bad(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.n_ctx is not None:
            raise bad("beam search keeps every beam's whole history: it cannot use a streaming cache (n_ctx)")
        if self.stop_strings():
            raise bad("stop strings are not supported with beam search (num_beams > 1)")
        if self.max_new_tokens is None:
            raise bad("beam search needs max_new_tokens")
        if not self.use_cache:
            raise bad("beam search always runs on its de-duplicated cache: use_cache=False is for greedy and "
                      "sampling (the naive reference)")

    def _validate_streaming(self, bad) -> None:
        if self.policy not in ("shift", "reevaluate"):
            raise bad(f"policy must be 'shift' or 'reevaluate', got {self.policy!r}")
        if self.n_ctx is None:
            return
        if not _is_int(self.n_ctx) or self.n_ctx < 2:
            raise bad(f"n_ctx must be an integer >= 2, got {self.n_ctx!r}")
        if not _is_int(self.n_keep) or not 0 <= self.n_keep < self.n_ctx - 1:
            raise bad(f"n_keep must be an integer in [0, n_ctx - 1), got {self.n_keep!r} with n_ctx={self.n_ctx}")
        window = self.n_ctx - self.n_keep
        if self.n_discard is not None and (not _is_int(self.n_discard) or not 1 <= self.n_discard < window):
            raise bad(f"n_discard must be an integer in [1, {window - 1}] (n_ctx - n_keep - 1), got {self.n_discard!r}")
        if self.num_return_sequences != 1:
            raise bad("streaming generation (n_ctx) produces one sequence per prompt: num_return_sequences must be 1")

    @property
    def discard_count(self) -> int:
        """Tokens dropped when the streaming cache is full. Default: one for shift (a true ring:
        the fullest window, and shifting costs nothing), half of the window for re-evaluate (each
        drop costs a rebuild, amortized over the tokens that refill it)."""
        if self.n_discard is not None:
            return self.n_discard
        return 1 if self.policy == "shift" else max(1, (self.n_ctx - self.n_keep) // 2)

    @property
    def is_sampling(self) -> bool:
        """Sampling with temperature 0 is greedy, as users expect."""
        return bool(self.do_sample) and self.temperature > 0

    def eos_token_ids_or_none(self) -> list[int] | None:
        if self.eos_token_id is None:
            return None
        if isinstance(self.eos_token_id, (list, tuple)):
            return list(self.eos_token_id)
        return [self.eos_token_id]

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    return _is_number(value) and math.isfinite(value)


def derived_head_dim(hidden_size: Any, num_heads: Any,
                     names: tuple[str, str] = ("hidden_size", "num_attention_heads")) -> int:
    """hidden_size // num_heads, or a ValueError naming the config fields when that is not a whole
    positive number (a zero, a string, a float, heads that do not divide the width); the loaders
    turn it into a CheckpointError naming the checkpoint."""
    if not _is_int(hidden_size) or hidden_size < 1:
        raise ValueError(f"{names[0]} must be an integer >= 1, got {hidden_size!r}")
    if not _is_int(num_heads) or num_heads < 1:
        raise ValueError(f"{names[1]} must be an integer >= 1, got {num_heads!r}")
    if hidden_size % num_heads:
        raise ValueError(f"{names[1]} ({num_heads}) must divide {names[0]} ({hidden_size})")
    return hidden_size // num_heads
