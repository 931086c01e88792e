"""The scheduler: which sequences run in a step and how many tokens each; admission through the
cache's ``can_allocate`` / ``allocate``. It never touches a tensor.

``schedule()`` picks work within ``max_batch_tokens``: one token for every running sequence that is
decoding (plus the draft it verifies, engine/speculative.py), then the next chunk of every running
sequence still reading its prompt, then admits waiting sequences in FIFO order while the budget and
the free blocks allow. While any sequence is decoding, the prompt chunks of a step total at most
``prefill_chunk`` tokens (Sarathi-Serve's stall-free batching): a long prompt then costs the
decoding sequences a few slightly longer steps instead of one long one, which bounds their
per-token latency. With nobody decoding, the first prompt chunk gets the whole budget (a lone
prompt's fastest first token) and further prompts join it only up to ``prefill_chunk`` tokens in
all: prompts that arrive together are read a few per step, FIFO, so the first of them get their
first token after their own reading instead of after everyone's (16 chat clients arriving at once,
float32 SmolLM2-135M on 2 cores: every first token at 2.3 s when one step read all 16 prompts). A
sequence reserves blocks for its prompt and all its new tokens at admission, sharing any cached
prefix, so a running sequence never runs out of room and nothing is ever preempted (a model with
sliding-window layers: full blocks for the full layers, and for each sliding kind a reservation of
what its window and one chunk need, chunks then capped at ``prefill_chunk``; engine/slots.py).
A beam group's beams are scheduled together; a stream's chunk is its policy's (engine/stream_steps.py).
``update(work)`` advances the sequences by what ran and names their completed blocks for the
prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .beam_group import is_beam, whole_groups
from .cross import CrossStore
from .sequence import Sequence, TokenEvent
from .slots import SlotCache
from .stream_steps import chunk_tokens

Work = list[tuple[Sequence, int]]  # (sequence, tokens it runs this step)


class Scheduler:
    def __init__(self, cache: SlotCache, cross: CrossStore | None, max_batch_tokens: int, prefill_chunk: int,
                 max_chunk: int, draft: Callable[[list[Sequence]], None]):
        """``draft``: sets each decoding sequence's draft before the budget is split (the speculator)."""
        self.cache, self.cross, self.draft = cache, cross, draft
        self.max_batch_tokens, self.prefill_chunk, self.max_chunk = max_batch_tokens, prefill_chunk, max_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def retire_cancelled(self, release: Callable[[Sequence], None]) -> list[TokenEvent]:
        """End every sequence whose cancel was requested; their blocks go back through ``release``."""
        events = []
        for sequence in [s for s in self.running if s.cancel_requested] + [s for s in self.waiting
                                                                             if s.cancel_requested]:
            events.append(sequence.end_event("cancelled"))
            release(sequence)
        self.retire_finished()
        self.waiting = deque(s for s in self.waiting if not s.finished)
        return events

    def retire_finished(self) -> None:
        self.running = [s for s in self.running if not s.finished]

    def schedule(self) -> Work:
        """(sequence, tokens to run) for this step: decodes first, then prompt chunks, then admissions."""
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        reading = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        decoding = whole_groups(decoding, self.max_batch_tokens)  # a beam group's beams run together
        self.draft(decoding)  # engine/speculative.py
        spare, work = self.max_batch_tokens - len(decoding), []
        for sequence in decoding:  # one token each, plus a draft to verify within what the decodes leave
            sequence.draft = sequence.draft[:spare]
            spare -= len(sequence.draft)
            work.append((sequence, 1 + len(sequence.draft)))
        budget = spare
        if work:
            budget = min(budget, self.prefill_chunk)  # prompt tokens this step (see the module docstring)
        untouched = True  # no prompt chunk taken yet: a stream's whole chunk may pass the budget
        for sequence in reading:
            count = chunk_tokens(sequence, budget, untouched, self.max_chunk)
            if count == 0:
                if sequence.stream is None:
                    break
                continue  # a stream's chunk waits for a step with room for it whole
            budget = self._after_chunk(work, sequence, count, budget, untouched)
            untouched = False
        while self.waiting and budget > 0:
            sequence = self.waiting[0]
            if not self.admit(sequence):
                break  # FIFO: the head waits for room, nobody overtakes it
            self.waiting.popleft()
            self.running.append(sequence)
            count = chunk_tokens(sequence, budget, untouched, self.max_chunk)
            if count:
                budget = self._after_chunk(work, sequence, count, budget, untouched)
                untouched = False
        return work

    def _after_chunk(self, work: Work, sequence: Sequence, count: int, budget: int, first: bool) -> int:
        """Take ``count`` prompt tokens of ``sequence`` into ``work`` -> the prompt budget left. The first
        chunk of a step nobody decodes in may take the whole budget; what follows it stays within
        ``prefill_chunk`` tokens in all (see the module docstring)."""
        idle = first and not work  # no decode and no chunk before this one
        work.append((sequence, count))
        if idle:
            budget = min(budget, max(self.prefill_chunk, count))
        return max(0, budget - count)

    def admit(self, sequence: Sequence) -> bool:
        """Reserve the blocks a waiting sequence needs -> False (nothing reserved) if they are not free.

        A new decoder-only sequence shares its prompt's cached prefix; a resumed one grows the
        blocks it kept; an encoder-decoder one also reserves its cross-attention blocks and never
        shares (its decoder's K/V depend on its source, not only on its tokens)."""
        if sequence.stream is not None:  # a stream holds blocks for all its positions
            if not sequence.stream.table:
                if not sequence.stream.can_admit():
                    return False
                sequence.stream.admit()
            return True
        cache, total, chunk = self.cache, sequence.total_tokens, self.max_chunk
        if sequence.group is not None:
            return sequence.group.admit(cache, self.cross, chunk)
        if sequence.block_table:  # resumed: it holds its computed tokens already
            return cache.grow(sequence.block_table, total, chunk)
        if sequence.source is not None:
            if not (self.cross.can_admit(sequence) and cache.can_allocate([], total, chunk)):
                return False
            sequence.block_table, _ = cache.allocate([], total, chunk)
            self.cross.admit(sequence)
            return True
        shared = [] if sequence.prompt_only else sequence.prompt_ids  # scoring wants every position's logits
        if not cache.can_allocate(shared, total, chunk):
            return False
        table, cached = cache.allocate(shared, total, chunk)
        pool = cache.pool
        sequence.block_table, sequence.num_computed = table, cached
        sequence.num_cached_prompt_tokens = cached
        sequence.block_hashes = pool.chain(shared, cached // pool.block_size)
        return True

    def update(self, work: Work) -> None:
        """After the forward: every sequence advances by what it ran (a verified draft advances by what
        is accepted, engine/speculative.py)."""
        for sequence, count in work:
            if not sequence.draft:
                self.computed(sequence, sequence.num_computed + count)

    def computed(self, sequence: Sequence, num_computed: int) -> None:
        """Advance a sequence and name its newly completed blocks for the prefix cache."""
        pool = self.cache.pool
        done_before, sequence.num_computed = sequence.num_computed // pool.block_size, num_computed
        done_now = num_computed // pool.block_size
        # unnamed: encoder-decoder K/V depend on the source, a stream's positions move, beams swap blocks
        if done_now > done_before and sequence.source is None and sequence.stream is None and not is_beam(sequence):
            self.cache.publish(sequence.block_table, sequence.tokens(0, num_computed), sequence.block_hashes,
                               done_now)
