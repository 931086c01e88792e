"""Beam search as a group of sequences of the engine, batched with everything else.

A request with ``num_beams = K`` is a *group*. Its root sequence (what ``Engine.submit`` returns)
runs the prompt like any other sequence (an encoder-decoder's: the decoder start token, its
source encoded at admission and stored once in the cross store). The root's logits go to the
group's policy (``BeamScores``: log-softmax, processors, running scores, the top candidates,
length penalty, early stopping), which forks K beam sequences with ``seq_keep`` (every prompt
block shared by reference) and gives each its first token. From then on the beams are ordinary
one-token rows of the engine's steps, beside greedy, sampling and other groups' rows; after each
forward the policy picks the K continuations and reorders the beams' block tables with
``seq_keep`` (no K/V moves; a beam's first write into a block it shares copies that block:
``SlotCache.writable``). In the step's plan a group's beams are one attention group folded
against their shared prompt blocks (FastSeq, engine/fastseq.py), so those keys are read once per
step for all K beams. An encoder-decoder group's beams read the root's cross blocks: the source's
K/V once per request.

Blocks: at admission the group takes its root's prompt blocks and a *spare* of fresh blocks, so
that with the prompt's full blocks shared, every beam can hold its own copy of the prompt's
partial block and the blocks of all its new tokens (``group_blocks``). The beams take blocks
from the pool as they write (``writable``), out of the spare: ``lend`` returns the spare to the
pool just before the step's writes, ``settle`` takes back what is still owed. Nothing else
allocates in between, so a group never runs out and nothing is preempted. When the group ends or
is cancelled, every block (root, beams, spare) and every reservation goes back.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Protocol

import torch

from ..errors import InvalidOptionError, PromptTooLongError
from ..layers.threads import one_thread
from .beam_scores import BeamScores, shared_candidates
from .sequence import Sequence, SequenceResult, TokenEvent
from .slots import SlotCache


class GroupPolicy(Protocol):
    """How a group chooses its rows' next tokens: ``BeamScores`` (Hugging Face beam search) by default,
    or a request's own (Whisper's search, speech/search.py)."""

    def advance(self, logits: torch.Tensor, selector) -> tuple[bool, torch.Tensor, torch.Tensor]:
        """The rows' logits [K, V] -> (whether the group goes on, the row each new row continues [K],
        the new rows' last tokens [K])."""

    def results(self) -> list[SequenceResult]:
        """The group's hypotheses, best first, once ``advance`` said it is over."""


def group_blocks(context: int, max_new_tokens: int, num_beams: int, block_size: int) -> int:
    """Full-kind blocks a group holds at most: the context's once, and per beam its copy of the
    context's partial block and its new tokens' blocks."""
    def blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    return blocks(context) + num_beams * (blocks(context + max_new_tokens) - context // block_size)


class BeamGroup:
    """The beams of one request and their policy. ``results``: the request's
    ``num_return_sequences`` hypotheses, best first, once it has finished."""

    def __init__(self, root: Sequence, eos_ids: list[int], tokenizer=None, folds: bool = True,
                 policy: GroupPolicy | None = None):
        config = root.config
        self.root, self.config, self.num_beams = root, config, config.num_beams
        self.folds = folds  # its beams attend folded against their shared prompt blocks (``fold_runs``)
        self.eos_ids, self.tokenizer = list(eos_ids), tokenizer
        root.group = self
        # On a GPU the beams' scores live on the host: the K x V candidates are chosen on the GPU, and
        # the few dozen small ops on 2K candidates after them cost less there than one launch each.
        self.scores = policy or BeamScores(config, eos_ids, torch.device("cpu"))
        self.selector = root.selector  # one row per beam from now on
        K = self.num_beams
        self.selector.start([root.context] * K, root.selector.eos_ids.device,
                            sources=None if root.source is None else [root.source] * K)
        self.beams: list[Sequence] = []
        self.cache: SlotCache | None = None
        self.spare: list[int] = []  # fresh full-kind blocks held for the beams' future writes
        self.window_reserved: dict[int, int] = {}  # what the group reserved in each sliding kind
        self.bound = 0
        self.results: list[SequenceResult] = []
        self.texts: list[str] = []
        if config.max_new_tokens == 0:
            self._set_results([SequenceResult([], "length", 0.0) for _ in range(config.num_return_sequences)])

    # -- admission ---------------------------------------------------------------------------------
    def _needs(self, cache: SlotCache, chunk: int) -> tuple[int, dict[int, int]]:
        """(full-kind blocks at most, blocks reserved in each sliding kind) of the whole group. A
        sliding kind holds the blocks of a subset of the same logical blocks, shared and copied as
        the full kind's are, so never more than the full kind's bound."""
        context, max_new, K = len(self.root.context), self.config.max_new_tokens, self.num_beams
        full = group_blocks(context, max_new, K, cache.block_size)
        windows = {w: min(full, cache.reservation(w, context, chunk) + K * cache.reservation(w, context + max_new, chunk))
                   for w in cache.window_pools}
        return full, windows

    def check_fits(self, cache: SlotCache, chunk: int) -> None:
        """A group that could never fit the pools is refused before it waits for room."""
        full, windows = self._needs(cache, chunk)
        what = (f"beam search with {self.num_beams} beams over {len(self.root.context)} tokens and "
                f"max_new_tokens={self.config.max_new_tokens}")
        if full > cache.pool.num_blocks:
            raise PromptTooLongError(f"{what} needs {full * cache.block_size} cache slots but the engine's cache "
                                     f"holds {cache.capacity_tokens}: lower num_beams or max_new_tokens, or give "
                                     f"the engine more cache_tokens")
        for w, need in windows.items():
            if need > cache.window_pools[w].num_blocks:
                raise PromptTooLongError(f"{what} needs {need} blocks of the sliding-window (window {w}) cache at "
                                         f"once but it holds {cache.window_pools[w].num_blocks}: give the engine "
                                         f"more cache_tokens")

    def admit(self, cache: SlotCache, cross, chunk: int) -> bool:
        """Reserve everything the group needs (checked before anything is taken) -> False, taking
        nothing, when it is not free. The root then runs its prompt as any sequence does."""
        root, pool = self.root, cache.pool
        prompt = root.prompt_ids if root.source is None else []  # an encoder-decoder's decoder K/V are not shared
        full, windows = self._needs(cache, chunk)
        shared = cache.cached_prefix(prompt)
        context_blocks = pool.blocks_for(len(root.context))
        if context_blocks - len(shared) + pool.revived(shared) + full - context_blocks > pool.num_free:
            return False
        if any(cache.window_pools[w].reserved + need > cache.window_pools[w].num_blocks for w, need in windows.items()):
            return False
        if cross is not None and not cross.can_admit(root):
            return False
        table, cached = cache.allocate(prompt, len(root.context), chunk)
        for w, count in table.reserved.items():  # the group's reservation covers the root's
            cache.window_pools[w].reserved -= count
        table.reserved = {}
        for w, need in windows.items():
            cache.window_pools[w].reserved += need
        self.cache, self.window_reserved, self.bound = cache, windows, full
        self.spare = pool.take(full - context_blocks)
        root.block_table, root.num_computed = table, cached
        root.num_cached_prompt_tokens = cached
        root.block_hashes = pool.chain(prompt, cached // pool.block_size)
        if cross is not None:
            cross.admit(root)
        return True

    # -- blocks around a step's writes -------------------------------------------------------------
    def lend(self) -> None:
        """The spare goes back to the pool for the beams' writes of this step (``settle`` after)."""
        self.cache.pool.release(self.spare)
        self.spare = []

    def settle(self) -> None:
        """Hold again, as spare, what the group may still take: ``bound`` minus what it holds."""
        pool = self.cache.pool
        held = {b for s in [self.root, *self.beams] for b in s.block_table}
        owed = self.bound - len(held)
        if owed > len(self.spare):
            self.spare += pool.take(owed - len(self.spare))
        elif owed < len(self.spare):
            pool.release(self.spare[owed:])
            del self.spare[owed:]

    def release(self) -> None:
        """The group is over (finished or cancelled): every block and reservation goes back."""
        cache = self.cache
        for beam in self.beams:
            if not beam.finished:
                beam.finish("cancelled")
        if cache is None:
            return
        for sequence in [self.root, *self.beams]:
            if sequence.block_table:
                cache.release(sequence.block_table)
                sequence.block_table = []
        cache.pool.release(self.spare)
        self.spare = []
        for w, count in self.window_reserved.items():
            cache.window_pools[w].reserved -= count
        self.window_reserved = {}
        self.cache = None

    # -- the policy ----------------------------------------------------------------------------------
    def advance(self, logits: torch.Tensor, running: list[Sequence],
                candidates: tuple[torch.Tensor, torch.Tensor] | None = None) -> TokenEvent | None:
        """The group's rows' logits (the root's one row at the first step, then one per beam, in
        beam order) -> the root's final event when the search ends; else the beams move on (new
        beams join ``running``). ``candidates``: the step's, where ``shared_candidates`` chose them."""
        K = self.num_beams
        if not self.beams:
            logits = logits.repeat_interleave(K, dim=0)  # [K, V]: every beam starts from the same prompt
        if candidates is None:
            go_on, origin, tokens = self.scores.advance(logits, self.selector)
        else:
            go_on, origin, tokens = self.scores.advance(logits, self.selector, candidates)
        if not go_on:
            return self._finish()
        sources, token_ids = origin.tolist(), tokens.tolist()
        if not self.beams:  # every beam is the root so far (a constraint may pick more than beam 0's tokens)
            self.beams = [self._new_beam() for _ in range(K)]
            tables, outputs, table_sources = [self.root.block_table], [[]] * K, [0] * K
            self.root.block_table = []
            running += self.beams
        else:
            tables, outputs, table_sources = [b.block_table for b in self.beams], [b.output_ids for b in self.beams], sources
        for beam, table, source, token in zip(self.beams, self.cache.seq_keep(tables, table_sources), sources, token_ids):
            beam.block_table, beam.output_ids = table, outputs[source] + [token]
        self.settle()
        device = self.selector.eos_ids.device
        self.selector.select_rows(origin.to(device))
        self.selector.record(tokens.to(device))
        return None

    def _new_beam(self) -> Sequence:
        root = self.root
        beam = Sequence(root.id, root.prompt_ids, root.config, self.selector, self.eos_ids,
                        decoder_prompt=None if root.source is None else root.context)
        beam.group, beam.num_computed, beam.source_table = self, root.num_computed, root.source_table
        beam.source = root.source  # (an encoded speech window: engine/speech_source.py)
        return beam

    def _finish(self) -> TokenEvent:
        self._set_results(self.scores.results())
        self.root.finish(self.results[0].finish_reason)
        for beam in self.beams:
            beam.finish(self.root.stop_kind)
        return TokenEvent(self.root, None, "", None, None, True, self.root.finish_reason)

    def _set_results(self, results: list[SequenceResult]) -> None:
        self.results = results
        if self.tokenizer is not None:
            self.texts = [self.tokenizer.decode(r.tokens, skip_special_tokens=True) for r in results]


# -- the scheduler's hooks ---------------------------------------------------------------------------
def is_beam(sequence: Sequence) -> bool:
    """A beam of a group (not its root): its blocks are never named for the prefix cache (a reorder
    gives it another beam's blocks)."""
    return sequence.group is not None and sequence is not sequence.group.root


def whole_groups(decoding: list[Sequence], limit: int) -> list[Sequence]:
    """The first ``limit`` decoding rows, without splitting a group's beams (they run together)."""
    chosen = decoding[:limit]
    if len(chosen) < len(decoding) and is_beam(decoding[len(chosen)]):  # beams are side by side in ``running``
        split = decoding[len(chosen)].group
        chosen = [s for s in chosen if s.group is not split]
    return chosen


@contextmanager
def lent_spares(work: list[tuple[Sequence, int]]):
    """Around the step's ``prepare`` calls: each group's spare blocks back in the pool."""
    groups = list({id(s.group): s.group for s, _ in work if is_beam(s)}.values())
    for group in groups:
        group.lend()
    try:
        yield
    finally:
        for group in groups:
            group.settle()


def fold_runs(work: list[tuple[Sequence, int]]) -> dict[int, tuple[int, int]]:
    """First row -> (beams, shared blocks) of each group whose beams (two or more) sit side by side in
    ``work`` and share full prompt blocks: one attention group each, folded against those blocks (a
    group of one beam, a greedy Whisper window, shares its blocks with no row: it stays paged). Only when
    every one-token row of the step is such a beam of a folding group (as the beam engine folded a
    batch only when every sample shared a block): otherwise the step's decodes stay one paged
    group, which the fused C++ decode block serves (models/llama_decode.py). On a float model a
    beam's attention can then run folded alone and paged beside a short prompt (equal to float
    rounding); a quantized model's groups never fold (``folds_beams``), so its results never
    depend on their neighbours."""
    rows = [s for s, _ in work]
    runs, index = {}, 0
    while index < len(work):
        sequence, count = work[index]
        K = _beam_run(rows, index) if count == 1 else 0
        shared = len(sequence.group.root.context) // sequence.group.cache.block_size if K > 1 and sequence.group.folds else 0
        if shared:
            runs[index] = (K, shared)
            index += K
            continue
        if count == 1:
            return {}
        index += 1
    return runs


def folds_beams(model) -> bool:
    """Whether the beams of this model's groups may fold (FastSeq). Not where the fused C++ decode
    block runs quantized products (models/llama_decode.py): a fold takes every row of its step off
    that block, and the int8 rounding of a quantized model's decode rows turns the float-rounding
    difference between a folded and a paged step into different beams (measured on the embedded
    SmolLM2 Q4_1: a 16-token prompt's beams differ from the first token), so that a request's
    answer would depend on what runs beside it. Nor where a model's decoder layers run as one op per
    step (Whisper's ``fused_layers``, models/whisper_decode.py): that op takes paged steps only, so a fold
    took every beam step after a full prompt block (long-form windows, conditioned on the previous text)
    onto the Python loop (tiny.en int8 long-form, beam 5: 1,068 of 1,428 layer-steps), and an int8
    window's beams then depended on whether a row beside them kept the step paged."""
    if getattr(model, "fused_layers", None) is not None:
        return False
    fused = getattr(model, "fused_decode", None)
    return fused is None or not fused.runs_quantized_products


def _beam_run(rows: list[Sequence], index: int) -> int:
    """The number of beams of one group that start at ``rows[index]``, side by side, else 0."""
    sequence = rows[index]
    if not is_beam(sequence) or sequence.group.beams[0] is not sequence:
        return 0
    beams = sequence.group.beams
    return len(beams) if rows[index : index + len(beams)] == beams else 0


def cross_row_groups(singles: list[Sequence]) -> list[tuple[int, list[Sequence], int]]:
    """The cross-attention row groups (engine/cross.py) of a step's one-query rows, which lead its
    flat tokens: a group's beams are the K queries of its root's one source (its K/V gathered once
    for them, no mask among them: cross-attention has none), runs of other rows one row each."""
    groups, index, start = [], 0, 0
    while index < len(singles):
        K = _beam_run(singles, index)
        if not K:
            index += 1
            continue
        if start < index:
            groups.append((start, singles[start:index], 1))
        groups.append((index, [singles[index].group.root], K))
        index = start = index + K
    if start < len(singles):
        groups.append((start, singles[start:], 1))
    return groups


def advance_groups(sampled: list[Sequence], logits: torch.Tensor, running: list[Sequence],
                   release: Callable[[Sequence], None]) -> tuple[list[Sequence], torch.Tensor, list[TokenEvent]]:
    """Hand each group's rows of the step's logits [S, V] to its policy -> (the other sequences,
    their logits, the events of groups that ended: their blocks are free)."""
    plain, plain_rows, first = [], [], 0  # a sequence verifying a draft has 1 + k rows (engine/layout.py)
    grouped: dict[int, tuple[BeamGroup, list[int]]] = {}
    for s in sampled:
        if s.group is not None:
            grouped.setdefault(id(s.group), (s.group, []))[1].append(first)
        else:
            plain.append(s)
            plain_rows += range(first, first + 1 + len(s.draft))
        first += 1 + len(s.draft)
    events = []
    groups = list(grouped.values())  # the beam steps of groups past their first share one candidates call
    shared = shared_candidates([(g.scores, g.selector, rows[0]) for g, rows in groups], logits) if all(
        g.beams and rows == list(range(rows[0], rows[0] + g.num_beams)) for g, rows in groups) else None
    for index, (group, rows) in enumerate(groups):
        event = group.advance(_take_rows(logits, rows), running, None if shared is None else shared[index])
        if event is not None:
            release(group.root)
            events.append(event)
    return plain, _take_rows(logits, plain_rows), events


def _take_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """logits [S, V] -> these rows [R, V]: a view when they are consecutive (a group's rows sit side
    by side), else a copy on one thread (an OpenMP barrier costs more than the copy: measured 22 ms
    a step on 2 busy cores for Whisper's beam-5 [5, 51864] logits)."""
    if rows == list(range(rows[0] if rows else 0, (rows[0] if rows else 0) + len(rows))):
        return logits[rows[0] : rows[0] + len(rows)] if rows else logits[:0]
    with one_thread():
        return logits[rows]


def check_beam_options(logprobs, keep: bool) -> None:
    if logprobs is not None:
        raise InvalidOptionError("logprobs are not available with beam search (num_beams > 1)")
    if keep:
        raise InvalidOptionError("a beam search request cannot be kept between turns (no chat)")
