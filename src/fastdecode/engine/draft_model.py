"""Draft-model speculation: a smaller model with the target's tokenizer drafts tokens greedily.

The draft model runs inside the target's engine process as its own engine (``Engine``: its own
slot cache and step plans), one draft sequence per speculating target sequence, driven by the
target engine's steps rather than by its own ``step``:
- a step that runs prompt chunks of target sequences runs the same chunks of their draft sequences
  in one forward of the draft model (``prefill``), so a draft's prompt is read while the target's
  is, chunk by chunk, never in a decode step (where a 600-token prompt cost the first draft ~7 s of
  the 0.5B draft's float prompt path on this CPU);
- before a decode step, every target sequence that wants a draft has its draft sequence brought in
  line with its tokens (the K/V of draft tokens the target rejected are dropped by moving the
  computed length back, as ``seq_rm`` would), then k batched greedy steps of the draft model
  propose k tokens for all of them at once: one forward per draft step over every drafting
  sequence (Python's planning of such a one-row step is ~0.2 ms of the draft's ~60 ms on
  Qwen2.5-Coder-0.5B, measured: the forwards are the cost, not the planning).
A greedy draft is a point mass, so verification (engine/speculative.py) stays exact whatever
arithmetic the draft model uses: its prompt rows take the int8 kernels as its generated rows do
(``RequestFactory.draft_model``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import InvalidOptionError

if TYPE_CHECKING:
    from .requests import RequestFactory
    from .sequence import Sequence


class DraftModelMismatchError(InvalidOptionError):
    """A draft model that cannot draft for the target: another vocabulary or other special tokens."""


class DraftModel:
    """A loaded draft model and its request factory (checked against the target at load)."""

    def __init__(self, model: Any, requests: "RequestFactory", path: str):
        self.model, self.requests, self.path = model, requests, path


def check_draft_compatible(path: str, target: "RequestFactory", draft: "RequestFactory") -> None:
    """The draft model must share the target's tokenizer: the same vocabulary (token strings and ids)
    and the same special ids; else DraftModelMismatchError naming the difference."""
    if target.tokenizer is None or draft.tokenizer is None:
        raise DraftModelMismatchError(f"draft model {path}: both models need a tokenizer to check that they share "
                                      "one")
    target_vocab = target.tokenizer.backend.get_vocab(with_added_tokens=True)
    draft_vocab = draft.tokenizer.backend.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])[:3]
        raise DraftModelMismatchError(f"draft model {path} has another vocabulary ({len(draft_vocab)} tokens against "
                                      f"the model's {len(target_vocab)}; e.g. {differing}): a draft model must share "
                                      "the model's tokenizer")
    for name in ("bos_token_id", "eos_token_ids"):
        if getattr(target.tokenizer, name) != getattr(draft.tokenizer, name):
            raise DraftModelMismatchError(f"draft model {path}: its {name} {getattr(draft.tokenizer, name)!r} differs "
                                          f"from the model's {getattr(target.tokenizer, name)!r}")
    if draft.model_config.is_encoder_decoder or target.model_config.is_encoder_decoder:
        raise DraftModelMismatchError("draft models are for decoder-only models (an encoder-decoder model drafts "
                                      "from its source with speculative='ngram')")


class DraftRunner:
    """One draft model's sequences beside one target engine."""

    def __init__(self, engine: Any, target_vocab: int):
        """``engine``: the draft model's own engine (its slot cache and step plans), never stepped itself."""
        self.engine = engine
        self.target_vocab = target_vocab
        self.rows: dict[int, Sequence] = {}  # target sequence id -> its draft sequence
        self.tokens_drafted = 0

    def propose(self, wanted: list[tuple["Sequence", int]]) -> None:
        """Set ``draft`` on each target sequence: up to its wanted count of greedy draft tokens."""
        active: list[tuple[Sequence, Sequence, int]] = []
        for target, count in wanted:
            row = self._row(target)
            if row is not None:
                self._align(row, target)
                active.append((target, row, count))
        drafts: dict[int, list[int]] = {row.id: [] for _, row, _ in active}
        for round_ in range(max((count for _, _, count in active), default=0)):
            work = [(row, row.num_tokens - row.num_computed) for _, row, count in active if count > round_]
            for row, count in work:
                self.engine.cache.prepare(row.block_table, row.num_computed, row.num_computed + count)
            logits, sampled = self.engine.runner.forward_rows(work)  # [K, V]: one row per draft sequence
            for row, count in work:
                row.num_computed += count
            for row, token in zip(sampled, logits.argmax(dim=-1).tolist()):
                row.output_ids.append(token)
                drafts[row.id].append(token)
        for target, row, _ in active:
            draft = drafts[row.id]
            if any(token >= self.target_vocab for token in draft):  # the draft's padded rows: no such token
                draft = draft[:next(i for i, token in enumerate(draft) if token >= self.target_vocab)]
            target.draft = draft
            self.tokens_drafted += len(draft)

    def prefill(self, chunks: list[tuple["Sequence", int]]) -> None:
        """Run each target sequence's prompt chunk (target, tokens it runs this step) on its draft
        sequence too, all in one forward (a draft sequence that shares more of its prompt with the
        draft cache's prefix runs less; one that lags runs what it missed)."""
        work = []
        for target, count in chunks:
            row = self._row(target)
            end = min(target.num_computed + count, len(row.context)) if row is not None else 0
            if row is not None and end > row.num_computed:
                self.engine.cache.prepare(row.block_table, row.num_computed, end)
                work.append((row, end - row.num_computed))
        if work:
            self.engine.runner.forward_rows(work)  # (logits only where a row reaches its prompt's end)
            for row, count in work:
                self.engine.scheduler.computed(row, row.num_computed + count)

    def _row(self, target: "Sequence") -> "Sequence | None":
        """The target's draft sequence, admitted on first use (None while the draft cache is full)."""
        row = self.rows.get(target.id)
        if row is not None:
            return row
        from ..config.speculative import MAX_NUM_TOKENS

        request = self.engine.requests.request(list(target.prompt_ids), self._config(target, MAX_NUM_TOKENS), None)
        row = self.engine._new_sequence(request)
        if not self.engine.scheduler.admit(row):
            return None
        self.rows[target.id] = row
        return row

    def _config(self, target: "Sequence", extra: int):
        return self.engine.requests.generation_config({"max_new_tokens": target.config.max_new_tokens + extra + 1})

    @staticmethod
    def _align(row: "Sequence", target: "Sequence") -> None:
        """Make the draft sequence hold the target's tokens: keep the K/V of the common prefix, drop
        the rest (rejected draft tokens), the target's newer tokens pending."""
        tokens = target.tokens(0, target.num_tokens)
        mine = row.tokens(0, min(row.num_computed, len(tokens)))
        common = next((i for i, (a, b) in enumerate(zip(mine, tokens)) if a != b), len(mine))
        row.num_computed = min(row.num_computed, common, len(tokens) - 1)
        row.output_ids = tokens[len(row.context):]

    def release(self, target: "Sequence") -> None:
        row = self.rows.pop(target.id, None)
        if row is not None and row.block_table:
            self.engine.cache.release(row.block_table)
            row.block_table = []
