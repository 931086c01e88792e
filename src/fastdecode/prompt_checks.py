"""The checks every generation's token prompts pass before anything runs (the API, the engine's
``submit``, chat sessions and the server all go through ``RequestFactory.check_prompts``,
engine/requests.py)."""

from __future__ import annotations

from .config import GenerationConfig, ModelConfig
from .errors import InvalidOptionError, PromptTooLongError


def check_prompts(model: ModelConfig, prompts: list[list[int]], config: GenerationConfig) -> None:
    """Token prompts a generation can run: present, non-empty, in the vocabulary, within the context
    (prompt + max_new_tokens; an encoder-decoder model's source within its encoder), with options that
    apply to the model -> InvalidOptionError / PromptTooLongError naming the prompt."""
    if not prompts:
        raise InvalidOptionError("no prompts given")
    limit = model.max_position_embeddings
    if config.encoder_no_repeat_ngram_size > 0 and not model.is_encoder_decoder:
        raise InvalidOptionError("encoder_no_repeat_ngram_size is for encoder-decoder models (there is no source)")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise InvalidOptionError(f"prompt {index} is empty: give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < model.vocab_size]
        if bad:
            raise InvalidOptionError(
                f"prompt {index} has token ids outside the vocabulary [0, {model.vocab_size}): {bad[:5]}",
                option="prompt",
            )
        if model.is_encoder_decoder:
            if config.n_ctx is not None:
                raise InvalidOptionError("streaming (n_ctx) is for decoder-only models")
            _check_source_length(model, index, prompt, config)
        elif config.n_ctx is None and len(prompt) + config.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt {index} has {len(prompt)} tokens; with max_new_tokens={config.max_new_tokens} it "
                f"needs {len(prompt) + config.max_new_tokens} positions but the model's context is {limit}"
            )

def _check_source_length(model: ModelConfig, index: int, source: list[int], config: GenerationConfig) -> None:
    """Encoder and decoder each have their own positions: the source must fit the encoder's,
    the target (start token + all new tokens but the last) the decoder's. T5 has no limit."""
    source_limit, target_limit = model.max_source_positions, model.max_target_positions
    if source_limit is not None and len(source) > source_limit:
        raise PromptTooLongError(
            f"source {index} has {len(source)} tokens but the model's encoder has only {source_limit} positions"
        )
    if target_limit is not None and config.max_new_tokens > target_limit:
        raise PromptTooLongError(
            f"max_new_tokens={config.max_new_tokens} exceeds the {target_limit} positions of the model's decoder"
        )
