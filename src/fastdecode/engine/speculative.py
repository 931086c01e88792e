"""Speculative decoding in the engine: a drafter proposes tokens, one forward verifies them all.

A decoding sequence with a draft d1..dk runs k + 1 query rows in the step's plan (its last token and
the draft, like a short prompt chunk), beside every other sequence's rows. Its rows' logits are then
checked in order: row j is processed and chosen exactly as a normal decode step would choose the
token after d1..dj (the sequence's own processors, penalties, grammar and seeded generator); the
draft token d(j+1) is accepted when it is that choice, and the first choice that differs is kept as
the step's last token. So greedy output equals greedy without speculation token for token, and a
seeded sampled output equals the unspeculated one for the same seed: each kept token is drawn from
the same processed distribution with the same uniform number. (For a point-mass draft, as an n-gram
draft is, this is the standard rejection rule: the draft is accepted with probability p(d), and a
rejected row's token follows p restricted to the other tokens, the normalized residual.)

The K/V the rows wrote for rejected draft tokens lie past the sequence's computed length: the next
step overwrites them (the cache's ``seq_rm`` in effect), and the prefix cache only ever names blocks
of accepted tokens.

Each sequence adapts its draft length to what is accepted: a fully accepted draft grows it, a
rejected one shrinks it. A draft's length keeps its verify at a power-of-two number of rows (1 + k:
k = 1, 3, 7, 15): the int8 decode kernels run rows in tiles of 8, 4, 2 and 1 (layers/qmatmul.cpp,
qtiles.cpp), so 4 rows pass over the weights once and 3 rows twice (on the embedded SmolLM2, one
step of 2 / 3 / 4 / 5 / 8 rows costs ~1.3 / 1.6 / 1.4-1.6 / 1.7-2.0 / 1.9-2.5x one row). Prompt
lookup proposes only where the sequence repeats an n-gram, so it never pauses: a miss only drops
the next draft to one token, and while its recent acceptance stays under ~30% (where a draft costs
more than it gains) it drafts nothing, probing again now and then. A draft model's proposal costs its forwards whatever follows, and beside
other decoding sequences a draft's rows cost real compute, so there a miss pauses drafting for a
while before probing again, and drafting needs a higher recent acceptance (~60%) to go on.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol

import torch

from ..config.speculative import SpeculativeSettings, speculative_settings
from .sampler import sample_rows
from .sequence import TokenEvent, token_logprobs

if TYPE_CHECKING:
    from .draft_model import DraftRunner
    from .core import Engine
    from .sequence import Sequence

PAUSE_AFTER_MISSES = 1  # drafts in a row with nothing accepted before a draft model pauses
FIRST_LENGTH = 3  # the first draft's length (4 verify rows; it grows to 7, 15 while drafts are accepted)
PAUSE_STEPS = 8  # decode steps without drafting in a first pause; each pause in a row doubles it
MAX_PAUSE_STEPS = 256
# Beside other decoding sequences a draft's rows cost real compute (a batched step is no longer bound
# by reading the weights alone): a sequence drafts there only while its recent acceptance rate is at
# least this; while it is not, the rate creeps back up by RATE_RECOVERY a step, so it probes again.
BATCHED_MIN_RATE = 0.6
RATE_RECOVERY = 0.02
# Alone in a step, a verify of 2 or 4 rows costs ~1.3-1.45x a decode step (engine.step, the embedded
# SmolLM2 at a 100-token context): a draft pays once about 30% of its tokens are accepted. Below that
# rate a sequence drafts nothing, the rate creeping back up as above (open-ended text: few probes).
SOLO_MIN_RATE = 0.3
# A draft model's tokens cost a forward of it each: Qwen2.5-Coder-0.5B Q8_0 drafting for the 1.5B
# Q4_K_M, ~0.45 of a target step per draft token on this CPU (2 threads), a 4-row verify ~1.5 steps:
# a 3-token draft pays from ~78% of tokens accepted (a recent rate of ~0.6 accepted / drafted, the
# batched bar), so a draft model drafts alone only above that rate too.


class Drafter(Protocol):
    """Proposes the tokens likely to follow a sequence; told every token the sequence gains."""

    def extend(self, tokens: list[int]) -> None: ...

    def propose(self, count: int) -> list[int]: ...


class NgramDrafter:
    """Prompt lookup: the last n tokens (n from ``ngram_max`` down to ``ngram_min``) looked up among
    the earlier n-grams of the sequence (prompt and output) and of its documents (an encoder-decoder
    model's source, a predicted output); the tokens that followed the match are the draft. A match in
    the generated output wins over one in a document, which wins over one in the prompt.

    An index from each n-gram to the position after its latest occurrence is updated as tokens
    arrive (``ngram_max`` dict writes per token), so proposing costs O(n + count), never a scan."""

    def __init__(self, tokens: list[int], ngram_min: int, ngram_max: int, documents: tuple[list[int], ...] = ()):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.tokens: list[int] = []
        # n-gram -> (the token list it occurs in, the position after that occurrence)
        self.index: dict[tuple[int, ...], tuple[list[int], int]] = {}
        self.cursor: tuple[list[int], int] | None = None  # (token list, position) the next token should copy
        self.extend(tokens)
        for document in documents:  # indexed after the prompt: a match in a document wins over one in it
            for end in range(1, len(document)):  # occurrences ending before the document's last token
                self._index_ending(document, end)

    def _index_ending(self, tokens: list[int], end: int) -> None:
        """Name every n-gram that ends just before position ``end`` (so that tokens[end] follows it)."""
        for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
            self.index[tuple(tokens[end - n:end])] = (tokens, end)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            if self.tokens:
                self._index_ending(self.tokens, len(self.tokens))  # the n-grams the new token follows
            self.tokens.append(token)
            if self.cursor is not None:  # still copying from where the last draft came from?
                source, position = self.cursor
                matched = position < len(source) and source[position] == token
                self.cursor = (source, position + 1) if matched else None

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` tokens. While the sequence keeps copying from where the last draft came
        from, the draft continues there (a repeated n-gram elsewhere cannot pull it away); else the
        longest suffix is looked up. A match near the end of the sequence has few followers (a loop
        of period 3 has 3): the lookup then continues from the draft's own end, up to ``count``."""
        draft: list[int] = []
        if self.cursor is not None:
            source, position = self.cursor
            draft = source[position:position + count]
        while len(draft) < count:
            following = self._following(draft, count - len(draft))
            if not following:
                break
            draft += following
        return draft

    def _following(self, draft: list[int], count: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix of tokens + draft."""
        tokens = self.tokens
        for n in range(min(self.ngram_max, len(tokens) + len(draft)), self.ngram_min - 1, -1):
            suffix = (tokens[len(tokens) - max(0, n - len(draft)):] + draft)[-n:]
            found = self.index.get(tuple(suffix))
            if found is not None:
                source, start = found
                if not draft:
                    self.cursor = (source, start)
                return source[start:start + count]
        return []


class ModelDrafter:
    """A draft model's place in a sequence's speculation. The engine drafts for every such sequence
    of a step at once (``DraftRunner.propose`` over all of them); ``propose`` is the same for this one
    sequence alone. The runner aligns with the sequence's tokens itself, so ``extend`` has nothing to do."""

    def __init__(self, runner: "DraftRunner", sequence: "Sequence"):
        self.runner, self.sequence = runner, sequence

    def extend(self, tokens: list[int]) -> None:
        pass

    def propose(self, count: int) -> list[int]:
        self.runner.propose([(self.sequence, count)])
        return self.sequence.draft


def draft_length(count: int) -> int:
    """The longest draft of at most ``count`` tokens whose verify runs a power of two of rows (1 + k):
    0, 1, 3, 7, 15, 31 (see the module docstring)."""
    return (1 << (count + 1).bit_length() - 1) - 1 if count > 0 else 0


class Speculation:
    """A sequence's drafter, its adaptive draft length and its counts (drafted, accepted).
    ``pauses``: after a missed draft, stop drafting for a while (a drafter whose proposals cost
    forwards: a draft model); any drafter pauses after a miss in a step with other decoding sequences."""

    def __init__(self, drafter: "Drafter | ModelDrafter", settings: SpeculativeSettings, pauses: bool = True):
        self.drafter, self.pauses = drafter, pauses
        self.max_tokens = draft_length(settings.num_tokens)
        self.length = min(FIRST_LENGTH, self.max_tokens)
        self.misses = 0  # drafts in a row with nothing accepted
        self.paused = 0  # decode steps left without drafting
        self.pause_steps = PAUSE_STEPS  # the next pause's length (doubles while drafts keep missing)
        self.drafted = 0
        self.accepted = 0
        self.verify_steps = 0
        self.rate = 1.0  # recent share of drafted tokens accepted (moving average; optimistic at first)
        self.batched = False  # whether the last draft was verified beside other decoding sequences

    def wanted(self, room: int, batched: bool = False) -> int:
        """How many tokens to draft this step, at most ``room``: 0 while paused or while its recent
        acceptance is too low to pay (``batched``: other sequences decode in the step too, where the
        bar is higher, as it is for a drafter whose proposals cost forwards)."""
        self.batched = batched
        if self.paused:
            self.paused -= 1
            return 0
        if self.rate < (BATCHED_MIN_RATE if batched or self.pauses else SOLO_MIN_RATE):
            self.rate += RATE_RECOVERY
            return 0
        return draft_length(min(self.length, room))

    def draft(self, room: int) -> list[int]:
        """At most ``room`` tokens to verify this step (none while paused), from a token-level drafter."""
        count = self.wanted(room)
        return self.shaped(self.drafter.propose(count)) if count else []

    @staticmethod
    def shaped(draft: list[int]) -> list[int]:
        """A proposal cut to a draft length (a drafter may find fewer tokens than asked)."""
        return draft[:draft_length(len(draft))]

    def settle(self, drafted: int, accepted: int) -> None:
        """Count a verified draft and adapt the next draft's length."""
        self.drafted += drafted
        self.accepted += accepted
        self.verify_steps += 1
        self.rate = 0.7 * self.rate + 0.3 * accepted / max(drafted, 1)
        if accepted == 0:
            self.length = min(1, self.max_tokens)
            self.misses += 1
            if (self.pauses or self.batched) and self.misses >= PAUSE_AFTER_MISSES:  # probe again after it
                self.paused, self.misses = self.pause_steps, 0  # (and pause longer next time)
                self.pause_steps = min(MAX_PAUSE_STEPS, self.pause_steps * 2)
            return
        self.misses, self.pause_steps = 0, PAUSE_STEPS
        if accepted == drafted:
            self.length = min(self.max_tokens, 2 * drafted + 1)
        else:
            self.length = min(self.max_tokens, draft_length(accepted + 1))


class Speculator:
    """An engine's speculative decoding: gives new sequences their speculation, drafts for the
    decoding ones before a step (a draft model's drafts batched over all of them) and keeps what
    their verified rows confirm after it."""

    def __init__(self, engine: "Engine"):
        # held weakly: the engine owns its speculator, and a cycle would keep a finished call's engine (and
        # its K/V cache) alive until Python's next garbage collection (see Engine.__init__)
        self._engine = weakref.ref(engine)
        self.runners: dict[str, DraftRunner] = {}  # draft model path -> its sequences beside this engine

    @property
    def engine(self) -> Engine:
        return self._engine()

    def attach(self, sequence: "Sequence") -> None:
        settings = speculative_settings(sequence.config.speculative)
        if settings is None:
            return
        if settings.draft_model is None:  # prompt lookup over what the sequence holds (and its source)
            sequence.speculation = new_speculation(settings, sequence.tokens(0, sequence.num_tokens), sequence.source)
            return
        runner = self.runners.get(settings.draft_model)
        if runner is None:
            from .draft_model import DraftRunner

            engine = self.engine
            draft = engine.requests.draft_model(settings.draft_model, engine.model.kernels)
            draft_engine = type(engine)(draft.model, draft.requests, cache_tokens=engine.cache.capacity_tokens)
            runner = self.runners[settings.draft_model] = DraftRunner(draft_engine, engine.model.config.vocab_size)
        sequence.speculation = Speculation(ModelDrafter(runner, sequence), settings)

    def draft(self, decoding: list["Sequence"]) -> None:
        """Set ``draft`` on every decoding sequence: none, or tokens to verify this step. A draft never
        outruns the sequence's reservation (its max_new_tokens) or a chunk."""
        batched: dict[int, tuple[DraftRunner, list[tuple[Sequence, int]]]] = {}
        for sequence in decoding:
            sequence.draft = []
            spec = sequence.speculation
            if spec is None:
                continue
            room = min(self.engine.max_chunk - 1, sequence.config.max_new_tokens - len(sequence.output_ids) - 1)
            count = spec.wanted(room, batched=len(decoding) > 1)
            if not count:
                continue
            if isinstance(spec.drafter, ModelDrafter):
                runner = spec.drafter.runner
                batched.setdefault(id(runner), (runner, []))[1].append((sequence, count))
            else:
                sequence.draft = spec.shaped(spec.drafter.propose(count))
        for runner, wanted in batched.values():
            runner.propose(wanted)
            for sequence, _ in wanted:
                sequence.draft = sequence.speculation.shaped(sequence.draft)

    def prefill(self, work: list[tuple["Sequence", int]]) -> None:
        """The step's prompt chunks of sequences drafting with a draft model run on their draft
        sequences too (engine/draft_model.py), one draft forward per draft model."""
        chunks: dict[int, tuple[DraftRunner, list[tuple[Sequence, int]]]] = {}
        for sequence, count in work:
            spec = sequence.speculation
            if (spec is not None and isinstance(spec.drafter, ModelDrafter) and sequence.stream is None
                    and sequence.num_computed < len(sequence.context)):
                runner = spec.drafter.runner
                chunks.setdefault(id(runner), (runner, []))[1].append((sequence, count))
        for runner, wanted in chunks.values():
            runner.prefill(wanted)

    def sample(self, sampled: list["Sequence"], logits: torch.Tensor) -> list[TokenEvent]:
        """A step's tokens when some sequences verify drafts: plain rows as usual, then each verifying
        sequence's 1 + k rows (in ``sampled`` order, as the forward laid them out)."""
        engine = self.engine
        plain, plain_rows, verifying, first = [], [], [], 0
        for sequence in sampled:
            if sequence.draft:
                verifying.append((sequence, first))
                first += 1 + len(sequence.draft)
            else:
                plain.append(sequence)
                plain_rows.append(first)
                first += 1
        events = sample_rows(plain, logits[plain_rows], engine._release) if plain else []  # [P, V]
        for sequence, first in verifying:
            draft, sequence.draft = sequence.draft, []
            start = sequence.num_computed
            kept, accepted = verify_draft(sequence, draft, logits[first:first + 1 + len(draft)])  # [1 + k, V]
            sequence.speculation.settle(len(draft), accepted)
            engine.scheduler.computed(sequence, start + 1 + accepted)  # its last token and the accepted draft: cached
            if sequence.finished:
                engine._release(sequence)
            events += kept
        return events

    def release(self, sequence: "Sequence") -> None:
        if sequence.speculation is not None and isinstance(sequence.speculation.drafter, ModelDrafter):
            sequence.speculation.drafter.runner.release(sequence)


def new_speculation(settings: SpeculativeSettings, context: list[int], source: list[int] | None) -> Speculation:
    """A sequence's speculation state: prompt lookup over its context, its source (an encoder-decoder
    request's) and the request's prediction of its output."""
    prediction = list(settings.prediction)
    drafter = NgramDrafter(context, settings.ngram_min, settings.ngram_max, tuple(d for d in (source, prediction) if d))
    if prediction:  # the output is expected to start as the prediction does
        drafter.cursor = (prediction, 0)
    return Speculation(drafter, settings, pauses=False)


def verify_draft(sequence: "Sequence", draft: list[int], logits: torch.Tensor) -> tuple[list[TokenEvent], int]:
    """A verifying sequence's rows of logits [1 + k, V] (row j: after its last token and d1..dj) ->
    (the events of the tokens kept, how many draft tokens were accepted). Each row is chosen as a
    decode step would choose it; the loop stops at the first choice that differs from the draft or
    when the sequence finishes (EOS, a stop string, its length)."""
    selector, generated = sequence.selector, len(sequence.output_ids)
    greedy = all(selector.plain_greedy(generated + j) for j in range(len(draft) + 1))
    argmax = logits.argmax(dim=-1).tolist() if greedy else None  # one host sync for a plain greedy draft
    events, accepted = [], 0
    for j in range(len(draft) + 1):
        if argmax is not None:
            token = argmax[j]
        else:
            token = int(selector.select(logits[j : j + 1], len(sequence.output_ids))[0])
        logprob = top = None
        if sequence.logprobs is not None:
            chosen_lp, tops = token_logprobs(logits[j : j + 1], torch.tensor([token], device=logits.device),
                                             sequence.logprobs)
            logprob, top = chosen_lp[0], tops[0] if sequence.logprobs else None
        events.append(sequence.accept(token, logprob, top))
        if j < len(draft) and token == draft[j]:
            accepted += 1
        else:
            break
        if sequence.finished:
            break
    return events, accepted
