"""Encoder-decoder sequences whose source is already encoded: a speech window's cross K/V.

A Whisper window is not token ids: its source is 30 s of log-mel features, which the caller
encodes once (one batched encoder call for every window that starts, speech/batching.py) into
an ``EncodedSources`` of one window (each decoder layer's cross K/V, contiguous
``[1, H, 1500, D]``). That one window then serves every request the transcription makes of it:
the language detection, the search, the temperature fallback's retries. So in the engine such a
sequence's ``source`` *is* its ``EncodedSources``: admission encodes nothing and reserves no
cross blocks (the K/V exist already, owned by the transcription), and a step's cross-attention
reads each sequence's window where it lies, through the C++ op (engine/cross.py's
``EncodedSources.attend``: the keys read once for all the queries of a source, the beams of a
group folded into its query axis, no gather into blocks).

``EncodedSourceStore`` has the verbs of ``CrossStore`` (engine/cross.py) that the scheduler and the
beam groups call; ``cross_store`` picks the store a model's sources need.
"""

from __future__ import annotations

import torch

from ..errors import InvalidOptionError
from .cross import CrossStore, EncodedSources, RowGroup, cross_attention_runs
from .sequence import Sequence


def cross_store(model, source_tokens: int | None, block_size: int, default_bytes: int):
    """The cross-attention store of an encoder-decoder ``model`` (None for a decoder-only one):
    pre-encoded sources for a speech model (its config's ``source_kind`` is "audio"), else token
    sources encoded at admission into ``source_tokens`` slots (default: what ``default_bytes``
    holds, at most 64 contexts)."""
    cfg = model.config
    if not cfg.is_encoder_decoder:
        return None
    if cfg.source_kind == "audio":
        return EncodedSourceStore(model)
    if source_tokens is None:
        per_token = cfg.cross_cache_bytes_per_source_token(model.dtype.itemsize)
        source_tokens = min(default_bytes // per_token, 64 * cfg.max_position_embeddings)
    return CrossStore(model, source_tokens, block_size)


def take_request_extras(sequence: Sequence, request) -> None:
    """What a new sequence takes from its request beyond its tokens: a source that is not the
    prompt (an encoded window) and the prompt position whose logits it keeps."""
    if request.source is not None:
        sequence.source = request.source
    sequence.prompt_logits_at = request.prompt_logits_at


class EncodedSourceStore:
    """Sequences whose ``source`` is one encoded window (an ``EncodedSources`` of one source)."""

    def __init__(self, model):
        self.model = model

    def check_fits(self, source) -> None:
        """A source must be one window encoded by this model (``EncodedSources`` of one source, one
        K and one V per decoder layer)."""
        if not isinstance(source, EncodedSources):
            raise InvalidOptionError(f"this model's requests take an encoded window as their source "
                                     f"(EncodedSources), got {type(source).__name__}")
        if source.num_sources != 1 or len(source.keys) != self.model.config.num_layers:
            raise InvalidOptionError(f"a request's source must be one window with {self.model.config.num_layers} "
                                     f"layers of cross K/V, got {source.num_sources} windows and "
                                     f"{len(source.keys)} layers")

    def can_admit(self, sequence: Sequence) -> bool:
        return True  # its K/V exist already (the transcription owns them)

    def admit(self, sequence: Sequence) -> None:
        pass  # nothing to reserve or to encode

    def release(self, sequence: Sequence) -> None:
        """The sequence (and its group's beams) let go of the window: the K/V go once the transcription
        lets it go too, not when the cycle collector finds the finished group (root <-> group)."""
        group = sequence.group
        for done in [sequence, *(group.beams if group is not None else [])]:
            done.source = None

    def encode_pending(self) -> None:
        pass  # sources arrive encoded

    def step(self, groups: list[RowGroup]) -> "EncodedStep":
        return EncodedStep(groups)


class EncodedStep:
    """The cross-attention view of one engine step over pre-encoded sources: per row group
    (engine/cross.py's ``row_groups``: first flat token, sequences, queries per sequence), each
    sequence's queries attend to its own window."""

    def __init__(self, groups: list[RowGroup]):
        self.groups = groups

    def decode_sources(self, rows: int, head_dim: int) -> list[tuple[int, int, EncodedSources]] | None:
        """Each sequence's (first flat token, queries, window) in flat order, when they cover the step's
        ``rows`` tokens and the C++ cross-attention serves every window, as ``attend`` then runs it (the
        fused decoder layer's sources, models/whisper_decode.py); else None."""
        probe = torch.empty(0, head_dim)  # the queries' dtype, device and head dim, as cross_attention_runs reads them
        sources, next_row = [], 0
        for first, sequences, T in self.groups:
            for n, sequence in enumerate(sequences):
                source = sequence.source
                if (first + n * T != next_row or source.lengths is None
                        or not all(cross_attention_runs(probe, keys) for keys in source.keys)):
                    return None
                sources.append((next_row, T, source))
                next_row += T
        return sources if next_row == rows else None

    def attend(self, index: int, q: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """Cross-attention of decoder layer ``index``: q [1, H, N, D] (flat tokens) -> [1, H, N, D]."""
        outputs = []
        for first, sequences, T in self.groups:
            for n, sequence in enumerate(sequences):
                start = first + n * T
                qs = q[:, :, start : start + T]  # [1, H, T, D]: this source's queries (a group's beams folded)
                outputs.append(sequence.source.attend(index, qs, scale, threads)[0])  # [H, T, D]
        return torch.cat(outputs, dim=1)[None] if len(outputs) > 1 else outputs[0][None]  # [1, H, N, D]
