"""The decoder side of Whisper on the engine: the windows' cross K/V once, the beams on the slot cache.

``WhisperEngine`` is the encoder-decoder beam engine (generation/encdec.py) started from encoded
windows and multi-token prompts (the special-token prompt, optionally after previous text) instead
of token sources and one start token. It also reports the logits at each prompt's
``<|startoftranscript|>`` (the no-speech probability) from the same prefill forward.

The search (speech/search.py) drives any object with this engine's verbs, so a test can drive it
over another model's logits.
"""

from __future__ import annotations

import copy

import torch

from ..engine.cross import EncodedSources
from ..generation.encdec import EncoderDecoderBeamEngine


def encode_windows(model, features: torch.Tensor) -> EncodedSources:
    """Log-mel windows [B, M, 3000] -> each decoder layer's cross K/V of every window, once."""
    memory = model.encode(features)  # [B, 1500, C]
    valid = torch.ones(memory.shape[:2], dtype=torch.bool, device=memory.device)  # [B, 1500]
    return EncodedSources.from_memory(model, memory, valid)


class WhisperEngine(EncoderDecoderBeamEngine):
    """``start(prompts, sot_index)`` -> (logits at each prompt's end [B, V], logits at its
    ``<|startoftranscript|>`` [B, V]); then ``decode``, ``reorder_beams``, ``keep_samples``."""

    def __init__(self, model, sources: EncodedSources, num_beams: int, max_new_tokens: int):
        super().__init__(model, num_beams, max_new_tokens)
        self.sources = copy.copy(sources)  # keep_samples narrows this copy, never the caller's
        self._sot_at: torch.Tensor | None = None
        self.sot_logits: torch.Tensor | None = None

    def start(self, prompts: list[list[int]], sot_index: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        self._prompt_lengths = [len(p) for p in prompts]
        starts = torch.tensor([0] + self._prompt_lengths[:-1]).cumsum(0)  # [B] first flat token of each
        self._sot_at = starts + torch.tensor(sot_index)  # [B]
        logits = super(EncoderDecoderBeamEngine, self).start(prompts)  # DecoderBeamEngine.start: one forward
        self.shared_nbytes += self.sources.nbytes
        return logits, self.sot_logits

    def _run_model(self, tokens, positions, plan, logits_at, num_rows):
        if self._sot_at is None:
            return super()._run_model(tokens, positions, plan, logits_at, num_rows)
        # the prefill, prompts side by side: also the logits at each <|startoftranscript|>
        both = torch.cat([logits_at, self._sot_at.to(logits_at.device)])  # [2B]
        cross = PromptCross(self.sources, self._prompt_lengths)
        logits = self.model.decode(tokens, positions, plan, cross, logits_at=both)  # [1, 2B, V]
        self._sot_at = None
        self.sot_logits = logits[0, num_rows:]  # [B, V]
        return logits[:, :num_rows]


class PromptCross:
    """The cross-attention view of a prefill: flat tokens ``[1, N]``, each source's prompt in turn
    (``lengths``, one per source). The prompts' queries are right-padded to one length per source,
    ``[B, H, L, D]``, so every source's K/V are read once in one batched call."""

    def __init__(self, sources: EncodedSources, lengths: list[int]):
        self.sources, self.lengths = sources, lengths
        self.longest = max(lengths)
        device = sources.keys[0].device
        rows = [b * self.longest + i for b, n in enumerate(lengths) for i in range(n)]
        self.rows = torch.tensor(rows, device=device)  # [N] padded row of each flat token

    def attend(self, index: int, q: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """q [1, H, N, D] -> [1, H, N, D] (``threads``: the forward's thread budget)."""
        H, D = q.shape[1], q.shape[3]
        B, L = len(self.lengths), self.longest
        padded = q.new_zeros(H, B * L, D).index_copy_(1, self.rows, q[0])  # [H, B*L, D]
        out = self.sources.attend(index, padded.unflatten(1, (B, L)).transpose(0, 1), scale, threads)  # [B, H, L, D]
        return out.transpose(0, 1).flatten(1, 2).index_select(1, self.rows)[None]  # [1, H, N, D]
