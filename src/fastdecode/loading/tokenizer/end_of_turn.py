"""The end-of-turn tokens a chat template writes: end-of-generation ids besides the config's own
(shared by the tokenizer.json loader, core.py, and the GGUF one, from_gguf.py)."""

from __future__ import annotations

import tokenizers

# Tokens that end an assistant turn in common chat formats. They count as end-of-generation ids
# when the chat template writes them (the model learned to emit them where the template does),
# even if the config's single ``eos_token_id`` names another token.
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)


def template_end_of_turn_ids(backend: tokenizers.Tokenizer, template: str | None) -> list[int]:
    """Known end-of-turn tokens (``<|im_end|>``, ``<|eot_id|>``...) that the chat template writes."""
    if not template:
        return []
    found = []
    for text in END_OF_TURN_TOKENS:
        if text in template:
            token_id = backend.token_to_id(text)
            if token_id is not None:
                found.append(token_id)
    return found
