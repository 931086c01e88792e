"""Embeddings as sequences of the engine: ``Generator.embed`` and the server's ``POST /v1/embeddings``.

An embedding sequence runs its text's tokens as a prompt, in chunks, in the same steps as
everything else, and produces no token. For the positions it pools (every one for ``mean``, the
last for ``last``, the choice of embedding models trained on causal decoders) the step's forward
returns the final normed hidden states instead of logits: ``forward_outputs`` runs the model with
``hidden=True`` at the logit rows and those rows, hands the embedding sequences theirs and runs the
model's ``head`` on the logit rows alone, so the other sequences get the logits a plain step gives
them. The sequence keeps a running float32 sum (``mean``) or the last state (``last``), so memory
stays at one vector whatever the length; when its last position has run it ends like a scoring
sequence (engine/scoring.py ``finish_scored``: no prefix-cache hits taken, blocks freed) and its
``embedding`` is the pooled vector, L2-normalized.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..config import GenerationConfig
from ..errors import InvalidOptionError
from ..validation import check_text, token_ids
from .scoring import check_prompt_only
from .sequence import Sequence

POOLINGS = ("mean", "last")


class EmbeddingSequence(Sequence):
    """The text ``ids``; after it ends, ``embedding`` is its unit-length pooled vector [C] (float32)."""

    embeds = prompt_only = True

    def __init__(self, seq_id: int, ids: list[int], pooling: str):
        super().__init__(seq_id, ids, GenerationConfig(max_new_tokens=0), selector=None, eos_ids=[])
        self.pooling = pooling
        self._pooled: torch.Tensor | None = None  # [C] float32: the sum of the states so far, or the last one

    def pooled_offsets(self, start: int, count: int) -> range:
        """Which of the rows of its chunk of ``count`` positions from ``start`` it pools."""
        if self.pooling == "mean":
            return range(count)
        return range(count - 1, count) if start + count == self.num_tokens else range(0)

    def take_hidden(self, hidden: torch.Tensor) -> None:
        """hidden [R, C]: the final normed states of the rows ``pooled_offsets`` named, in order."""
        if hidden.shape[0] == 0:
            return
        if self.pooling == "last":
            self._pooled = hidden[-1].float()
            return
        chunk = hidden.float().sum(dim=0)  # [C]
        self._pooled = chunk if self._pooled is None else self._pooled + chunk

    @property
    def embedding(self) -> torch.Tensor:
        if self._pooled is None or self.finish_reason != "length":
            raise InvalidOptionError("the embedding exists once the sequence has run all its tokens")
        pooled = self._pooled / len(self.prompt_ids) if self.pooling == "mean" else self._pooled
        return torch.nn.functional.normalize(pooled, dim=-1)


def embedding_sequence(engine: Any, ids: Seq[int], pooling: str, seq_id: int) -> EmbeddingSequence:
    """A validated embedding sequence for ``engine`` (not yet queued)."""
    if pooling not in POOLINGS:
        raise InvalidOptionError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    ids = list(ids)
    check_prompt_only(engine, ids, len(ids), "embedding", f"a text of {len(ids)} tokens to embed")
    return EmbeddingSequence(seq_id, ids, pooling)


def submit_embedding(engine: Any, ids: Seq[int], pooling: str = "mean") -> EmbeddingSequence:
    """Queue a text to embed in ``engine``: its pooled final hidden states, no new token."""
    sequence = embedding_sequence(engine, ids, pooling, engine._next_id)
    engine._next_id += 1  # (the engine numbers its sequences in submission order)
    engine.waiting.append(sequence)
    return sequence


def forward_outputs(model: Any, tokens: torch.Tensor, positions: torch.Tensor, plan: Any, logits_at: torch.Tensor,
                    layout: Any) -> torch.Tensor:
    """One step's forward (tokens, positions [1, N]) -> logits [K, V] at ``logits_at`` [K]; the
    embedding sequences of ``layout`` (engine/layout.py) take the hidden states of its ``hidden_rows``."""
    if not layout.hidden_rows:
        return model.forward(tokens, positions, plan, logits_at=logits_at)[0]  # [K, V]
    wanted = torch.tensor(layout.hidden_rows, dtype=torch.long, device=logits_at.device)
    hidden = model.forward(tokens, positions, plan, logits_at=torch.cat([logits_at, wanted]),
                           hidden=True)  # [1, K + E, C]
    first = logits_at.shape[0]
    for sequence, count in layout.embedded:
        sequence.take_hidden(hidden[0, first : first + count])
        first += count
    return model.head(hidden[:, : logits_at.shape[0]], plan.products)[0]  # [K, V]


def embedding_inputs(requests: Any, inputs: Any) -> list[list[int]]:
    """``Generator.embed``'s argument: a text, a list of texts, one token-id list or a list of them
    -> token-id lists (texts encoded with the tokenizer's special tokens, as the server does)."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and
                                   all(isinstance(t, int) and not isinstance(t, bool) for t in inputs)):
        inputs = [inputs]
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise InvalidOptionError("embed takes a text, a non-empty list of texts, a list of token ids or a list of "
                                 f"token-id lists, got {inputs!r:.80}")
    prompts = []
    for index, item in enumerate(inputs):
        if isinstance(item, (str, bytes, bytearray)):
            text = check_text(item, f"input {index}")
            prompts.append(requests.require_tokenizer().encode(text, add_special_tokens=True))
        else:
            prompts.append(token_ids(item, f"input {index}"))
    return prompts


def embed_alone(generator: Any, prompts: list[list[int]], pooling: str = "mean") -> torch.Tensor:
    """Embed token-id lists in an engine of their own (``Generator.embed``) -> [N, C] float32, unit rows."""
    longest = max((len(p) for p in prompts), default=0)
    cache_tokens = max(1, min(sum(len(p) for p in prompts), max(longest, 8192)))
    engine = generator.engine(cache_tokens=cache_tokens, max_queue=len(prompts), cuda_graphs=False)  # nothing decodes
    sequences = [submit_embedding(engine, ids, pooling) for ids in prompts]
    while engine.has_work():
        engine.step()
    return torch.stack([sequence.embedding for sequence in sequences])
