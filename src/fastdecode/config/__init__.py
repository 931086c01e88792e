"""Configurations: ``ModelConfig`` (canonical model fields, model.py) and ``GenerationConfig``
(the generation options, generation.py). Import them from here."""

from .generation import INT_OPTION_LIMIT, INT_OPTIONS, SEED_LIMIT, GenerationConfig
from .model import FULL, SLIDING, EncoderDecoderConfig, ModelConfig, derived_head_dim

__all__ = ["FULL", "INT_OPTIONS", "INT_OPTION_LIMIT", "SEED_LIMIT", "SLIDING", "EncoderDecoderConfig",
           "GenerationConfig", "ModelConfig", "derived_head_dim"]
