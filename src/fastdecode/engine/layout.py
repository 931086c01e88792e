"""A step's flat layout: the tokens of every sequence in the step, side by side in one row.

``flat_layout(work)`` turns (sequence, tokens to run) pairs into the rows the plan attends with and
the flat tokens, positions and roles the model runs, and says which flat rows' logits are wanted:
- one-token rows first (decodes; they attend as one group), then each longer chunk;
- a sequence verifying a draft (engine/speculative.py) runs its last token and the draft as that
  many one-token rows over its own block table, positions p..p+k, and all their logits are kept;
- a scoring sequence (engine/scoring.py) keeps every position's logits (``kept_rows``, after the
  sampled rows in ``logits_at`` order);
- an embedding sequence (engine/embedding_rows.py) wants the final hidden states of the positions
  it pools (``hidden_rows``: the forward returns those instead of logits);
- any other sequence's logits are wanted at its last token, once it reaches it, and at its
  ``prompt_logits_at`` position when it has one (kept as a scoring row is, one row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass
class FlatLayout:
    rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # (sequence, first position, tokens)
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    is_prompt: list[bool] = field(default_factory=list)  # each token's role: a prompt token or a generated one
    logit_rows: list[int] = field(default_factory=list)  # flat rows whose logits are sampled (or verified)
    sampled: list[Sequence] = field(default_factory=list)  # their sequences, once each, in logits order
    kept_rows: list[int] = field(default_factory=list)  # flat rows of scoring sequences
    scored: list[tuple[Sequence, int]] = field(default_factory=list)  # (scoring sequence, its rows)
    hidden_rows: list[int] = field(default_factory=list)  # flat rows whose hidden states embedding sequences pool
    embedded: list[tuple[Sequence, int]] = field(default_factory=list)  # (embedding sequence, its hidden rows)

    @property
    def logits_at(self) -> list[int]:
        return self.logit_rows + self.kept_rows


def flat_layout(work: list[tuple[Sequence, int]]) -> FlatLayout:
    layout = FlatLayout()
    verifying = [(s, s.num_computed + j, 1) for s, count in work if s.draft for j in range(count)]
    layout.rows = [(s, s.num_computed, count) for s, count in work if count == 1 and not s.draft] + verifying
    layout.rows += [(s, s.num_computed, count) for s, count in work if count > 1 and not s.draft]
    tokens = layout.tokens
    for sequence, start, count in layout.rows:
        if sequence.draft:  # its last token, then the draft
            offset = start - sequence.num_computed
            tokens.append(sequence.draft[offset - 1] if offset else sequence.tokens(start, start + 1)[0])
        else:
            tokens += sequence.tokens(start, start + count)
        layout.positions += range(start, start + count)
        layout.is_prompt += (index < len(sequence.context) for index in range(start, start + count))
        if sequence.keeps_logits:
            layout.kept_rows += range(len(tokens) - count, len(tokens))
            layout.scored.append((sequence, count))
        elif sequence.embeds:
            wanted = sequence.pooled_offsets(start, count)  # of this chunk's rows
            layout.hidden_rows += (len(tokens) - count + offset for offset in wanted)
            layout.embedded.append((sequence, len(wanted)))
        elif sequence.draft or start + count == sequence.num_tokens:
            layout.logit_rows.append(len(tokens) - 1)
            if not layout.sampled or layout.sampled[-1] is not sequence:
                layout.sampled.append(sequence)
        watched = sequence.prompt_logits_at
        if watched is not None and start <= watched < start + count and not sequence.draft:
            layout.kept_rows.append(len(tokens) - count + watched - start)  # handed to its ``take_logits``
            layout.scored.append((sequence, 1))
    return layout
