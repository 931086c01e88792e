"""How the pipeline's generation stage hands inputs to the model: ``submit`` an input as it arrives,
``step`` until some finish, no batches of its own.

* ``EngineFeeder`` (greedy and sampling): ONE engine for the whole run (continuous batching): an
  input is submitted as soon as there is room, runs in the same steps as everything already
  running, and leaves as soon as it finishes, its place taken by the next input at once. Nothing
  is padded or sorted: the engine's scheduler does all the batching.
* ``CallFeeder``: the strategies the engine does not run yet (beam search, streaming caches
  ``n_ctx``, ``use_cache=False``, ``best_of``) go through ``generate_ids_with_details``: each step
  is one call over the inputs gathered since the last one (as many as there is room for), in
  arrival order.

Either way, an input whose submission or generation raises a ``FastDecodeError`` (a prompt too
long, a bad ``response_format``) fails alone, as an error outcome.

Room: ``InFlight`` admits an input while fewer than ``batch_size`` inputs are generating (or their
cache tokens, ``rows x (prompt + max_new_tokens)`` unpadded, stay within ``max_batch_tokens``) and
while it is within ``lookahead`` inputs of the oldest one not yet written, which bounds the
reorder buffer (and so memory) whatever the lengths.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from ..config import GenerationConfig
from ..errors import FastDecodeError
from ..engine.sequence import SequenceResult
from .inputs import InputItem
from .settings import BatchSettings

Outcome = list[SequenceResult] | FastDecodeError  # an input's r results, or why it failed


def runs_in_engine(config: GenerationConfig) -> bool:
    """Whether the continuous engine runs this configuration (greedy and sampling); the rest go
    through ``generate_ids_with_details`` (see the module docstring)."""
    best_of = config.best_of is not None and config.is_sampling and config.best_of > config.num_return_sequences
    return config.num_beams == 1 and config.n_ctx is None and config.use_cache and not best_of


def cache_tokens_for(model: Any, max_new_tokens: int) -> int:
    """The engine's default cache, but room for one input of the model's whole context at least:
    a batch run takes every input ``generate`` takes (the default budget holds fewer tokens than
    the context of a large model). On the CPU the slots cost memory only once used."""
    from ..engine.core import DEFAULT_CACHE_BYTES

    cfg = model.config
    default = min(DEFAULT_CACHE_BYTES // cfg.kv_cache_bytes_per_token(model.model.dtype.itemsize),
                  64 * cfg.max_position_embeddings)
    return max(default, cfg.max_position_embeddings, 1 + max_new_tokens)


class InFlight:
    """Which inputs may enter generation now (see the module docstring)."""

    def __init__(self, settings: BatchSettings, config: GenerationConfig):
        self.rows, self.token_budget, self.window = settings.rows, settings.max_batch_tokens, settings.window
        self.rows_per_input, self.max_new_tokens = config.num_return_sequences, config.max_new_tokens
        self.inputs = 0
        self.tokens = 0

    def cost(self, item: InputItem) -> int:
        return self.rows_per_input * (len(item.ids or ()) + self.max_new_tokens)

    def admits(self, item: InputItem, written: int) -> bool:
        """``written``: inputs already delivered in order (the seq of the oldest one not written)."""
        if item.seq >= written + self.window:
            return False
        if self.inputs == 0:
            return True  # an input over the token budget on its own still runs, alone
        if self.rows is not None:
            return self.inputs < self.rows
        return self.tokens + self.cost(item) <= self.token_budget

    def enter(self, item: InputItem) -> None:
        self.inputs += 1
        self.tokens += self.cost(item)

    def leave(self, item: InputItem) -> None:
        self.inputs -= 1
        self.tokens -= self.cost(item)


class Feeder(Protocol):
    fills_up: bool  # whether inputs should be gathered until there is no room before a step

    def submit(self, item: InputItem, options: dict[str, Any]) -> Outcome | None:
        """Start generating ``item`` -> None, or at once its failure."""

    def step(self) -> list[tuple[InputItem, Outcome]]:
        """Advance generation -> the inputs that finished (possibly none)."""

    def has_work(self) -> bool: ...


class EngineFeeder:
    """Inputs as sequences of one long-lived engine (``model.engine()``)."""

    fills_up = False  # the engine takes new inputs at every step

    def __init__(self, model: Any, max_inputs: int, rows_per_input: int, max_new_tokens: int):
        self.engine = model.engine(max_queue=max(1, max_inputs * rows_per_input),
                                   cache_tokens=cache_tokens_for(model, max_new_tokens))
        self.pending: dict[int, tuple[InputItem, list[Any]]] = {}  # sequence id -> (input, its sequences)

    def submit(self, item: InputItem, options: dict[str, Any]) -> Outcome | None:
        try:
            sequences = self.engine.submit_choices(item.ids, options)
        except FastDecodeError as exc:
            return exc
        entry = (item, sequences)
        for sequence in sequences:
            self.pending[sequence.id] = entry
        return None

    def step(self) -> list[tuple[InputItem, Outcome]]:
        done = []
        for event in self.engine.step():
            if not event.finished:
                continue
            item, sequences = self.pending.pop(event.sequence.id)
            if not any(sequence.id in self.pending for sequence in sequences):  # its last choice ended
                done.append((item, [SequenceResult(s.output_ids, s.stop_kind) for s in sequences]))
        return done

    def has_work(self) -> bool:
        return self.engine.has_work()


class CallFeeder:
    """Inputs gathered between steps, then generated by one ``generate_ids_with_details`` call per
    ``response_format`` group; seeds per input (``seed`` a list, one value per prompt)."""

    fills_up = True  # a call runs to its end: start it with as many inputs as there is room for

    def __init__(self, model: Any, seeded: bool):
        self.model, self.seeded = model, seeded
        self.waiting: list[tuple[InputItem, dict[str, Any]]] = []

    def submit(self, item: InputItem, options: dict[str, Any]) -> Outcome | None:
        self.waiting.append((item, options))
        return None

    def step(self) -> list[tuple[InputItem, Outcome]]:
        groups: dict[str, list[tuple[InputItem, dict[str, Any]]]] = {}
        for item, options in self.waiting:
            key = json.dumps({k: v for k, v in options.items() if k != "seed"}, sort_keys=True, default=repr)
            groups.setdefault(key, []).append((item, options))
        self.waiting = []
        done = []
        for group in groups.values():
            done += zip([item for item, _ in group], self._generate(group))
        return done

    def _generate(self, group: list[tuple[InputItem, dict[str, Any]]]) -> list[Outcome]:
        """Each input's results; a call that raises a FastDecodeError is retried one input at a
        time, so that only the bad input fails."""
        options = dict(group[0][1])
        if self.seeded:
            options["seed"] = [opts["seed"] for _, opts in group]
        try:
            flat = self.model.generate_ids_with_details([item.ids for item, _ in group], **options)
        except FastDecodeError as exc:
            if len(group) == 1:
                return [exc]
            return [self._generate([entry])[0] for entry in group]
        r = len(flat) // len(group)
        return [flat[index * r:(index + 1) * r] for index in range(len(group))]

    def has_work(self) -> bool:
        return bool(self.waiting)
