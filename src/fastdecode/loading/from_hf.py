"""Wrap an in-memory ``transformers`` model: same config mapping, weights shared (no copies)."""

from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError
from .checkpoint import Checkpoint, canonical_weights, check_tokenizer_matches
from .hf_folder import build_config, with_generation_config
from .names import check_weight_shapes, resolve_weight_names


def checkpoint_from_hf(hf_model: Any, tokenizer: Any = None) -> Checkpoint:
    if not hasattr(hf_model, "config") or not hasattr(hf_model, "state_dict"):
        raise UnsupportedModelError(
            f"from_hf expects a transformers PreTrainedModel, got {type(hf_model).__name__}"
        )
    generation = getattr(hf_model, "generation_config", None)
    generation = generation.to_dict() if generation is not None else None
    hf_config = with_generation_config(hf_model.config.to_dict(), generation)
    family, config = build_config(hf_config, f"in-memory {type(hf_model).__name__}")
    module = family.load_module()
    state = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    required, optional = module.weight_names(config)
    mapping = resolve_weight_names(required, optional, module.HF_NAMES, config.layer_counts, state,
                                   module.IGNORED_NAME_PATTERNS, f"in-memory {type(hf_model).__name__}")
    check_weight_shapes(module, config, mapping, lambda name: state[name].shape, f"in-memory {type(hf_model).__name__}")
    weights = canonical_weights(mapping, state.__getitem__, module.OUT_IN_WEIGHTS, config, share=True)

    wrapped = None
    if tokenizer is not None:
        from .tokenizer import Tokenizer

        wrapped = Tokenizer.from_hf_tokenizer(tokenizer)
        check_tokenizer_matches(wrapped, config, "the given tokenizer")
    return Checkpoint(config, family, weights, wrapped, f"in-memory {type(hf_model).__name__}",
                      "transformers (in memory)")
