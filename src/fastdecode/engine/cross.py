"""Encoder-decoder requests in the engine: the encoder at admission, cross-attention K/V per sequence.

An encoder-decoder sequence is admitted like any other (self-attention blocks for its decoder
tokens) and also reserves blocks in a second block store, the *cross store* (engine/source_blocks.py:
each head's keys consecutive within a block), for the K/V its source gives every decoder layer. In the
step that admits it, the encoder runs once over its source (every source admitted in that step in one
right-padded batch: the encoder masks the padding, so a source's output never depends on its batch),
each decoder layer projects the cross K/V once, and only the real tokens' K/V are written to the
sequence's cross blocks. They stay there, unchanged, until the sequence finishes or is cancelled (``release``).

In the step's one flat forward (tokens of many sequences side by side, ``[1, N]``), each query of
a decoder layer's cross-attention reads only its own source's K/V, through its sequence's cross
block table, up to its source's length (``CrossStep``: in place where the C++ ops run, the queries
of one source together, else each fold's sources gathered under a key mask), so no row ever sees
another request's source or padding.

``EncodedSources`` (the ``use_cache=False`` reference loop's sources, generation/reference.py; each
Whisper window, whose encoded source a request of the engine carries: engine/speech_source.py)
encodes sources once, in one right-padded batch, and keeps each source's cross K/V once,
contiguous per layer (no block table to gather through at every step: the sources never change
during a search). On the CPU that attention is one C++ op (layers/cross_attention.cpp: 8 keys at a
time for all the queries of a source, the padding never read), about 1.3-2x faster than SDPA's
kernel on 4 queries per source.
"""

from __future__ import annotations

import torch

from ..errors import PromptTooLongError
from ..layers.attention import attention
from ..layers import ops
from ..layers.products import Products
from ..layers.threads import kernel_threads, one_thread
from ..models.seq2seq import padding_bias
from .sequence import Sequence
from .source_blocks import SourceBlocks

RowGroup = tuple[int, list[Sequence], int]  # (first flat token, its sequences, queries per sequence)


def row_groups(work: list[tuple[Sequence, int]]) -> list[RowGroup]:
    """A step's cross-attention groups, (first flat token, sequences, queries each): one group for
    all one-query rows, one per longer chunk (``work`` is in that order)."""
    from .beam_group import cross_row_groups  # a beam group's beams: the queries of their one source

    singles = [s for s, count in work if count == 1]
    groups = cross_row_groups(singles)
    first = len(singles)
    for sequence, count in work[len(singles):]:
        groups.append((first, [sequence], count))
        first += count
    return groups


def right_pad(sources: list[list[int]], device: torch.device, pad_id: int = 0):
    """-> tokens [B, S], valid [B, S], positions [1, S] (the same 0..S-1 for every row).

    Every row's real tokens sit at positions 0..n-1, exactly as when the source is alone, so the
    positions and T5's encoder bias are shared by the whole batch; the padding is masked out of
    encoder self-attention and of every cross-attention."""
    B, S = len(sources), max(len(s) for s in sources)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    valid = torch.zeros((B, S), dtype=torch.bool)
    for row, source in enumerate(sources):
        tokens[row, : len(source)] = torch.tensor(source, dtype=torch.long)
        valid[row, : len(source)] = True
    positions = torch.arange(S, dtype=torch.long)[None]  # [1, S]
    return tokens.to(device), valid.to(device), positions.to(device)


def decoder_score_bias(model):
    """The decoder self-attention's position bias for a step plan: T5's relative buckets (learned
    and sinusoidal positions are added to the embeddings instead)."""
    return model.decoder_position_bias if model.config.position_kind == "relative" else None


def _source_rows(model) -> Products:
    """The products of source rows: prompt rows, on the caller's threads."""
    return Products.prompt(torch.get_num_threads(), kernels=model.kernels)


def encoder_output(model, sources: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder run once over every source, one right-padded batch (the encoder masks the padding,
    so a source's output never depends on its batch) -> memory [B, S, C], valid [B, S]."""
    tokens, valid, positions = right_pad(sources, model.device)
    return model.encode(tokens, positions, valid, products=_source_rows(model)), valid


def cross_kv_views(model, memory: torch.Tensor):
    """Each decoder layer's cross K, V [B, H, S, D] of the encoder output [B, S, C], projected once
    (views of the projection's output: the caller copies them where it keeps them)."""
    products = _source_rows(model)
    for layer in range(model.config.num_layers):
        yield model.cross_kv(layer, memory, products)


class CrossStore:
    """The cross-attention K/V of every admitted encoder-decoder sequence, in blocks of a slot cache
    with one layer per decoder layer: ``[blocks * block_size, H, D]`` per layer for K and for V."""

    def __init__(self, model, source_tokens: int, block_size: int):
        cfg = model.config
        self.model = model
        num_blocks = max(1, -(-source_tokens // block_size))
        self.cache = SourceBlocks(cfg.num_layers, num_blocks, cfg.num_heads, cfg.head_dim, model.dtype, model.device,
                                  block_size)
        self.pending: list[Sequence] = []  # admitted, not encoded yet

    @property
    def pool(self):
        return self.cache.pool

    def check_fits(self, source: list[int]) -> None:
        if self.pool.blocks_for(len(source)) > self.pool.num_blocks:
            raise PromptTooLongError(
                f"a source of {len(source)} tokens needs {len(source)} cross-attention slots but the engine's "
                f"cross-attention store holds {self.cache.capacity_tokens}: give the engine more source_tokens"
            )

    def can_admit(self, sequence: Sequence) -> bool:
        return self.pool.blocks_for(len(sequence.source)) <= self.pool.num_free

    def admit(self, sequence: Sequence) -> None:
        """Reserve the sequence's cross blocks (never shared: no prefix cache for sources); the
        encoder runs in ``encode_pending``, before the step's forward."""
        sequence.source_table, _ = self.pool.allocate([], len(sequence.source))
        self.pending.append(sequence)

    def release(self, sequence: Sequence) -> None:
        if sequence.source_table:
            self.pool.release(sequence.source_table)
            sequence.source_table = []
        if sequence in self.pending:
            self.pending.remove(sequence)

    def encode_pending(self) -> None:
        """Encode every source admitted since the last step and store its cross K/V."""
        if not self.pending:
            return
        memory, _ = encoder_output(self.model, [s.source for s in self.pending])  # [B, S, C]
        tables = [s.source_table for s in self.pending]
        for layer, (k, v) in enumerate(cross_kv_views(self.model, memory)):  # [B, H, S, D] views each
            # One copy: the projection's views straight into the blocks, on one thread. Each block run's copy_
            # is an OpenMP region of its own on the caller's threads (bart-base, 8 x 256 sources: 96 copies of
            # 0.8 MB), and with the second core busy every one waited for it: 2.1 s of a greedy call on two
            # threads at load 8, against ~0.1-0.3 s on one.
            with one_thread():
                self.cache.write(layer, tables, k, v)
        self.pending.clear()

    def step(self, groups: list[RowGroup]) -> "CrossStep":
        return CrossStep(self.cache, groups, self.model.dtype)


class CrossStep:
    """The cross-attention view of one engine step (the decoder calls ``attend`` per layer).

    Where the C++ op runs (float32 queries on the CPU), every query of the step reads its own
    source's K/V in place through its sequence's cross block table (layers/cross_attention.cpp
    ``paged_cross_attention``: a head's keys a block at a time, no gather), the queries that share a
    source (a beam group's K beams, a decoder prompt chunk's tokens) together: they are one row of the
    op (``SourceFold``), so the source is read once for them. Each query is computed by the same
    operations whatever its row's other queries and the step's other rows: a row's result never
    depends on its batch. Elsewhere (a GPU, half precision) each fold gathers its sources' blocks and
    runs one ``attention`` call under a key mask for all of them."""

    def __init__(self, cache: SourceBlocks, groups: list[RowGroup], dtype: torch.dtype):
        self.cache = cache
        self.folds = source_folds(cache, groups)  # one SourceFold per count of queries sharing a source
        self.paged = paged_cross_attention_runs(torch.empty(0, dtype=dtype, device=cache.device), cache.layer_keys[0])

    def attend(self, index: int, q: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """Cross-attention of decoder layer ``index``: q [1, H, N, D] (flat tokens) -> [1, H, N, D]
        (``threads``: the forward's thread budget)."""
        operands = (self.cache, self.cache.layer_keys[index], self.cache.layer_values[index], scale, threads,
                    self.paged)
        if len(self.folds) == 1:  # (one count of queries per source: the fold's rows are every row, in order)
            return self.folds[0].attend(q[0], *operands)[None]
        out = torch.empty_like(q[0])  # [H, N, D]
        for fold in self.folds:
            out[:, fold.rows] = fold.attend(q[0], *operands)
        return out[None]  # [1, H, N, D]


class SourceFold:
    """U sources of a step, each read by G queries (a beam group's K beams, a decoder prompt chunk's
    tokens, or G = 1: a row alone): one row of the paged op per source, its G queries together."""

    def __init__(self, cache: SourceBlocks, queries: int, units: list[tuple[int, Sequence]]):
        device = cache.device
        self.queries = queries
        firsts = torch.tensor([first for first, _ in units], dtype=torch.long, device=device)  # [U]
        self.rows = (firsts[:, None] + torch.arange(queries, device=device)).flatten()  # [U * G] flat tokens
        lengths = [len(s.source) for _, s in units]
        self.lengths = torch.tensor(lengths, dtype=torch.long, device=device)  # [U]
        self.longest = max(lengths)
        num_blocks = cache.pool.blocks_for(self.longest)
        self.table = cache.block_tables([s.source_table for _, s in units], num_blocks)  # [U, n]
        self.mask: torch.Tensor | None = None  # the gathered route's key mask [U, 1, 1, S] (``_key_mask``)

    def attend(self, q: torch.Tensor, cache: SourceBlocks, keys: torch.Tensor, values: torch.Tensor, scale: float,
               threads: int, paged: bool) -> torch.Tensor:
        """q [H, N, D] (the step's flat queries) -> this fold's rows' outputs [H, U * G, D]. ``paged``: the
        C++ op reads the sources in place; else (a GPU, half precision) they are gathered [U, H, S, D]
        and attend in one ``attention`` call under the key mask, every source at once."""
        H, D, G = q.shape[0], q.shape[2], self.queries
        U = self.table.shape[0]
        mine = q if q.shape[1] == len(self.rows) else q[:, self.rows]  # [H, U * G, D] (every row: in order)
        rows = mine.unflatten(1, (U, G)).transpose(0, 1)  # [H, U, G, D] -> [U, H, G, D] (a view)
        if paged:
            threads = kernel_threads(2 * rows.numel() * self.longest, threads)  # U*H*G*D * S multiply-adds, twice
            out = ops.paged_cross_attention(rows, keys, values, self.table, self.lengths, scale, threads)
        else:
            out = attention(rows, cache.gather(keys, self.table), cache.gather(values, self.table),
                            self._key_mask(cache.block_size, q.dtype), scale, threads=threads)
        return out.transpose(0, 1).reshape(H, U * G, D)  # [U, H, G, D] -> [H, U, G, D] -> [H, U * G, D]

    def _key_mask(self, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The gathered sources' key mask [U, 1, 1, S]: -inf past each source's length (made once)."""
        if self.mask is None:
            slots = torch.arange(self.table.shape[1] * block_size, device=self.table.device)  # [S]
            mask = torch.zeros(self.table.shape[0], slots.shape[0], dtype=dtype, device=self.table.device)
            mask = mask.masked_fill(slots[None, :] >= self.lengths[:, None], float("-inf"))  # [U, S]
            self.mask = mask[:, None, None]  # [U, 1, 1, S]
        return self.mask


def source_folds(cache: SourceBlocks, groups: list[RowGroup]) -> list[SourceFold]:
    """A step's cross-attention row groups as folds by queries per source: one fold of single rows,
    one per other count (a beam group of K beams: K queries of its root's source; a decoder prompt
    chunk of T tokens: T queries of its sequence's)."""
    by_queries: dict[int, list[tuple[int, Sequence]]] = {}
    for first, sequences, queries in groups:
        for i, sequence in enumerate(sequences):
            by_queries.setdefault(queries, []).append((first + i * queries, sequence))
    return [SourceFold(cache, queries, units) for queries, units in sorted(by_queries.items())]


class EncodedSources:
    """The cross-attention K/V of B sources, once per source: per decoder layer K and V
    ``[B, H, S, D]`` (S: the longest source), which slots are real tokens ``valid`` ``[B, S]`` and
    the source-padding mask ``bias`` ``[B, 1, 1, S]`` (None when no source is padded)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor):
        self.keys, self.values, self.valid = keys, values, valid
        self.bias = padding_bias(valid, keys[0].dtype)
        self.lengths = source_lengths(valid)

    @classmethod
    def encode(cls, model, sources: list[list[int]]) -> "EncodedSources":
        """Run the encoder once over every source (one right-padded batch: the encoder masks the
        padding, so a source's output never depends on its batch), then project each decoder
        layer's cross K/V once."""
        return cls.from_memory(model, *encoder_output(model, sources))

    @classmethod
    def from_padded(cls, model, tokens: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor) -> "EncodedSources":
        """Right-padded sources: tokens, valid [B, S], positions [1, S] (``right_pad``). K/V are made
        contiguous here, once: a strided view would be copied by every step's attention."""
        return cls.from_memory(model, model.encode(tokens, positions, valid, products=_source_rows(model)), valid)

    @classmethod
    def from_memory(cls, model, memory: torch.Tensor, valid: torch.Tensor) -> "EncodedSources":
        """An encoder output [B, S, C] (a speech encoder's, say) -> each decoder layer's cross K/V,
        projected once; ``valid`` [B, S] marks its real rows."""
        keys, values = [], []
        for k, v in cross_kv_views(model, memory):  # [B, H, S, D]
            keys.append(k.contiguous())
            values.append(v.contiguous())
        return cls(keys, values, valid)

    @property
    def num_sources(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))

    def attend(self, index: int, q: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """Cross-attention of decoder layer ``index``, one row per source: q [B, H, T, D] -> [B, H, T, D].
        The C++ op (layers/cross_attention.cpp) where it serves these tensors: it reads each source's
        keys once for its T queries and never reads its padding; else SDPA under the padding mask."""
        keys, values = self.keys[index], self.values[index]
        if self.lengths is None or not cross_attention_runs(q, keys):
            if keys.dtype != q.dtype:  # K/V stored narrower (a Whisper int8 model's float16)
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            bias = None if self.bias is None else self.bias.to(q.dtype)
            return attention(q, keys, values, bias, scale, threads=threads)
        threads = kernel_threads(2 * q.numel() * keys.shape[2], threads)  # B*H*T*D * S multiply-adds, twice
        return ops.cross_attention(q if q.stride(-1) == 1 else q.contiguous(), keys, values, self.lengths, scale,
                                   threads)


def source_lengths(valid: torch.Tensor) -> torch.Tensor | None:
    """valid [B, S] -> each row's count of real tokens [B] (int64) when they lead the row (right
    padding, as ``right_pad`` makes) and none is empty, else None."""
    lengths = valid.sum(dim=-1)  # [B]
    leading = torch.arange(valid.shape[1], device=valid.device)[None, :] < lengths[:, None]  # [B, S]
    return lengths.contiguous() if torch.equal(leading, valid) and bool((lengths > 0).all()) else None


def paged_cross_attention_runs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the C++ cross-attention over source blocks serves these tensors (float32 queries and
    keys on the CPU, head dims a multiple of 8, the extension built); else the caller gathers."""
    return (q.dtype == torch.float32 and keys.dtype == torch.float32 and q.device.type == "cpu"
            and keys.shape[-1] % 8 == 0 and ops.available())


def cross_attention_runs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether the C++ cross-attention serves these tensors (float32 queries on the CPU, float32 or
    float16 keys, head dims a multiple of 8, contiguous [B, H, S, D] keys, the extension built); else
    the caller runs SDPA."""
    return (q.dtype == torch.float32 and keys.dtype in (torch.float32, torch.float16) and q.device.type == "cpu"
            and q.shape[-1] % 8 == 0 and keys.is_contiguous() and ops.available())
