"""Word-level timestamps: the cross-attention of the alignment heads, aligned to the audio by DTW.

As openai-whisper's ``find_alignment`` (and CTranslate2's ``Whisper.align`` under faster-whisper):
one forward of ``sot_sequence + <|notimestamps|> + text + <|endoftext|>`` over a window's cross
K/V, recording each alignment head's cross-attention logits; over the window's frames only
(``num_frames // 2`` encoder positions), softmax, normalized per head over the tokens, median
filtered in time (width 7), averaged over the heads; dynamic time warping of the negated matrix
then gives each token its first encoder position (20 ms each). Words are the tokens grouped at
spaces (or at whole characters for languages written without spaces); a word's probability is the
mean of its tokens' (softmax over the text tokens).
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np
import torch

from ..layers.products import Products
from .vocabulary import WhisperVocabulary

TOKENS_PER_SECOND = 50  # encoder positions per second of audio
MEDIAN_FILTER_WIDTH = 7
NO_SPACE_LANGUAGES = {"zh", "ja", "th", "lo", "my", "yue"}


@dataclass
class WordTiming:
    word: str
    tokens: list[int]
    start: float  # seconds from the window's start
    end: float
    probability: float


class RecordingCross:
    """The cross-attention view of a naive decoder forward over one window (``[1, T]`` tokens) that
    keeps the attention logits of the alignment heads: ``logits[(layer, head)]`` [T, S]."""

    def __init__(self, sources, heads: list[tuple[int, int]]):
        self.sources, self.heads = sources, heads
        self.logits: dict[tuple[int, int], torch.Tensor] = {}

    def attend(self, index: int, q: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """q [1, H, T, D] -> [1, H, T, D] (small: on the forward's one thread whatever ``threads``)."""
        k, v = self.sources.keys[index][:1], self.sources.values[index][:1]  # [1, H, S, D]
        logits = (q.float() @ k.float().transpose(-1, -2)) * scale  # [1, H, T, S]
        for layer, head in self.heads:
            if layer == index:
                self.logits[(layer, head)] = logits[0, head]
        return (logits.softmax(dim=-1) @ v.float()).to(q.dtype)  # [1, H, T, D]


def default_alignment_heads(num_layers: int, num_heads: int) -> list[tuple[int, int]]:
    """Whisper's default when a checkpoint names none: every head of the second half of the layers."""
    return [(layer, head) for layer in range(num_layers // 2, num_layers) for head in range(num_heads)]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over the last dimension in windows of ``width`` (odd), reflect-padded: x [..., S]."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    flat = x.reshape(-1, 1, x.shape[-1])  # [N, 1, S]
    padded = torch.nn.functional.pad(flat, (pad, pad), mode="reflect")  # [N, 1, S + 2 pad]
    return padded.unfold(-1, width, 1).median(dim=-1).values.reshape(x.shape)  # [..., S]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through ``cost`` [N, M] from (0, 0) to (N-1, M-1), with
    openai-whisper's rule at each cell (diagonal if strictly cheapest, else up if strictly
    cheapest, else left) -> (row indices, column indices) along the path."""
    N, M = cost.shape
    inf = float("inf")
    above = [0.0] + [inf] * M  # the previous row's totals (row 0: only (0, 0) is reachable)
    trace = []  # per row 1..N: the move into each column 1..M (0 diagonal, 1 up, 2 left)
    for i in range(N):
        costs, row, moves = cost[i].tolist(), [inf], [1]
        left = inf
        for j in range(M):
            c0, c1 = above[j], above[j + 1]
            if c0 < c1 and c0 < left:
                left, move = c0 + costs[j], 0
            elif c1 < c0 and c1 < left:
                left, move = c1 + costs[j], 1
            else:
                left, move = left + costs[j], 2
            row.append(left)
            moves.append(move)
        above = row
        trace.append(moves)
    i, j, rows, cols = N, M, [], []
    while i > 0 or j > 0:
        rows.append(i - 1)
        cols.append(j - 1)
        move = trace[i - 1][j] if i > 0 and j > 0 else (2 if i == 0 else 1)
        if move == 0:
            i, j = i - 1, j - 1
        elif move == 1:
            i -= 1
        else:
            j -= 1
    return np.array(rows[::-1]), np.array(cols[::-1])


def split_words(vocabulary: WhisperVocabulary, tokens: list[int], language: str | None) -> tuple[list[str], list[list[int]]]:
    """Text tokens -> words and their tokens: whole characters first (a character may span tokens),
    then, except for languages written without spaces, joined until a space or punctuation."""
    full = vocabulary.decode(tokens)
    pieces, piece_tokens, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        decoded = vocabulary.decode(current)
        if "\ufffd" not in decoded or full[offset + decoded.index("\ufffd")] == "\ufffd":
            pieces.append(decoded)
            piece_tokens.append(current)
            current, offset = [], offset + len(decoded)
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words, word_tokens = [], []
    for piece, ids in zip(pieces, piece_tokens):
        if piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def align_words(model, vocabulary: WhisperVocabulary, sources, sot_sequence: list[int], text_tokens: list[int],
                num_frames: int, heads: list[tuple[int, int]], language: str | None) -> list[WordTiming]:
    """The words of ``text_tokens`` (a window's text, no timestamps) with their times in the window."""
    if not text_tokens:
        return []
    tokens = [*sot_sequence, vocabulary.no_timestamps, *text_tokens, vocabulary.eot]
    T = len(tokens)
    cross = RecordingCross(sources, heads)
    ids = torch.tensor([tokens], device=sources.keys[0].device)  # [1, T]
    products = Products.generated(torch.get_num_threads(), kernels=model.kernels)  # every row on the decode kernels
    logits = model.decode(ids, torch.arange(T, device=ids.device)[None], None, model.decoder_self_bias(T), cross,
                          all_logits=True, products=products)[0].float()  # [T, V]
    token_probs = logits[len(sot_sequence) : -1, : vocabulary.eot].softmax(dim=-1)  # [text + 1, eot]
    text_probs = token_probs[torch.arange(len(text_tokens)), torch.tensor(text_tokens)].tolist()
    weights = torch.stack([cross.logits[h][:, : num_frames // 2] for h in heads])  # [heads, T, frames / 2]
    weights = weights.softmax(dim=-1)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, MEDIAN_FILTER_WIDTH)
    matrix = weights.mean(dim=0)[len(sot_sequence) : -1]  # [text + 1, frames / 2]
    text_indices, time_indices = dtw(-matrix.double().numpy())
    words, word_tokens = split_words(vocabulary, text_tokens, language)
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens]), (1, 0))  # [words + 1]
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] / TOKENS_PER_SECOND  # the first position of each token (and the end's)
    return [WordTiming(word, ids, float(jump_times[a]), float(jump_times[b]), float(np.mean(text_probs[a:b])))
            for word, ids, a, b in zip(words, word_tokens, boundaries[:-1], boundaries[1:])]
