"""Choosing the next token from logits: the processor chain, then argmax or a seeded draw.

Seeding rule: every row (one sequence) draws from its own ``torch.Generator``, so a sequence's
samples depend only on its seed, never on the rows it is batched with. With ``seed=s`` (an int),
prompt i's return sequence j is seeded with ``derive_seed(s, j)`` whatever i is (a prompt gives
the same samples alone or in a batch); ``seed`` may also be a list with one seed per prompt (the
batch pipeline passes ``derive_seed(s, line)`` for each input line, so that resumed or re-batched
runs give the same records). Each step draws one uniform number per row and picks the token by
inverse CDF over the processed probabilities.
"""

from __future__ import annotations

import numpy as np
import torch

from ..config import GenerationConfig
from ..constraints import CompiledGrammar, GrammarState
from ..errors import InvalidOptionError
from ..layers import ops
from .ngram_table import NgramTable
from .processors import (
    PAD,
    apply_min_p,
    apply_presence_frequency_penalty,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    ban_mask,
    dense_logit_bias,
    encoder_no_repeat_ngram_ids,
    encoder_no_repeat_ngram_mask,
    force_tokens,
    no_repeat_ngram_ids,
    no_repeat_ngram_mask,
    suppress_tokens,
)


class TokenSelector:
    """Applies the configured processors and picks one token per row.

    Holds the per-row "seen tokens" mask for the repetition penalty and, for sampling, one seeded
    ``torch.Generator`` per row (see the seeding rule above); everything stays on the model's device.
    """

    def __init__(self, config: GenerationConfig, eos_ids: list[int], vocab_size: int, device: torch.device,
                 forced_bos: int | None = None, forced_eos: list[int] | tuple = (),
                 grammar: CompiledGrammar | None = None):
        self.config = config
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        # A model config's forced first / last token (BART-family configs set them), as transformers applies them.
        self.forced_bos = None if forced_bos is None else torch.tensor([forced_bos], dtype=torch.long, device=device)
        self.forced_eos = torch.tensor(list(forced_eos), dtype=torch.long, device=device) if forced_eos else None
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None
        # Token history [N, L] (left-padded with PAD) and sources [N, S] for n-gram blocking: the tensor
        # kernels' input (encoder no-repeat-n-gram blocking; no-repeat-n-gram blocking off the CPU).
        self.history: torch.Tensor | None = None
        self.ngrams: NgramTable | None = None  # no-repeat-n-gram blocking on the CPU: kept incrementally
        self.sources: torch.Tensor | None = None
        self.generators: list[torch.Generator] | None = None  # one per row (sampling only)
        self.counts: torch.Tensor | None = None  # [N, V] float: generated tokens (presence / frequency penalty)
        self.bias: torch.Tensor | None = None  # [V] float: logit_bias
        if config.logit_bias:
            too_large = [t for t in config.logit_bias if t >= vocab_size]
            if too_large:
                raise InvalidOptionError(f"logit_bias names token id {too_large[0]}, past the vocabulary "
                                         f"({vocab_size} tokens)")
            self.bias = dense_logit_bias(config.logit_bias, vocab_size, device)
        # A constrained generation: one grammar state per row (None: unconstrained, no work at all).
        self.grammar = grammar
        self.grammar_states: list[GrammarState] | None = None

    def start(self, prompts: list[list[int]], device: torch.device,
              sources: list[list[int]] | None = None, row_seeds: list[int] | None = None) -> None:
        """Record prompt tokens (repetition penalty, n-gram blocking) and, for encoder no-repeat-n-gram
        blocking, the encoder-decoder sources. ``row_seeds``: each row's sampling seed (default:
        ``derive_seed(seed, row)``, or fresh entropy without a seed)."""
        cfg = self.config
        if self.grammar is not None:
            self.grammar_states = [self.grammar.state() for _ in prompts]
        if cfg.is_sampling:
            if row_seeds is None and cfg.seed is not None:
                if not isinstance(cfg.seed, int):
                    raise InvalidOptionError("a list of seeds (one per prompt) is for generate / generate_ids")
                row_seeds = [derive_seed(cfg.seed, row) for row in range(len(prompts))]
            self.generators = row_generators(row_seeds, len(prompts), device)
        if cfg.no_repeat_ngram_size > 0 and device.type == "cpu":
            self.ngrams = NgramTable(prompts, cfg.no_repeat_ngram_size)
        if cfg.encoder_no_repeat_ngram_size > 0 or (cfg.no_repeat_ngram_size > 0 and self.ngrams is None):
            self.history = pad_rows(prompts, device)
        if cfg.encoder_no_repeat_ngram_size > 0 and sources is not None:
            self.sources = pad_rows(sources, device)
        if cfg.presence_penalty or cfg.frequency_penalty:
            self.counts = torch.zeros(len(prompts), self.vocab_size, dtype=torch.float32, device=device)
        if cfg.repetition_penalty == 1.0:
            return
        self.seen = torch.zeros(len(prompts), self.vocab_size, dtype=torch.bool, device=device)
        for row, prompt in enumerate(prompts):
            self.seen[row, torch.tensor(prompt, dtype=torch.long, device=device)] = True

    def select_rows(self, rows: torch.Tensor) -> None:
        """Row i of the per-row state becomes row ``rows[i]``: finished rows dropped, or (beam search)
        beams reordered and settled samples dropped, in one gather."""
        if self.seen is not None:
            self.seen = self.seen.index_select(0, rows)
        if self.history is not None:
            self.history = self.history.index_select(0, rows)
        if self.ngrams is not None:
            self.ngrams.select_rows(rows.tolist())
        if self.sources is not None:
            self.sources = self.sources.index_select(0, rows)
        if self.counts is not None:
            self.counts = self.counts.index_select(0, rows)
        if self.generators is not None:
            self.generators = [self.generators[row] for row in rows.tolist()]
        if self.grammar_states is not None:  # a row taken twice (two beams from one) forks its state
            taken: set[int] = set()
            states = []
            for row in rows.tolist():
                state = self.grammar_states[row]
                states.append(state.fork() if row in taken else state)
                taken.add(row)
            self.grammar_states = states

    def record(self, tokens: torch.Tensor) -> None:
        """Append the chosen tokens [N] to the per-row state."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens[:, None], True)  # row i's token seen (no host copy of the value on a GPU)
        if self.history is not None:
            self.history = torch.cat([self.history, tokens[:, None]], dim=1)  # [N, L+1]
        if self.ngrams is not None:
            self.ngrams.record(tokens.tolist())
        if self.counts is not None:
            self.counts[torch.arange(tokens.shape[0], device=tokens.device), tokens] += 1.0
        if self.grammar_states is not None:
            for state, token in zip(self.grammar_states, tokens.tolist()):
                state.advance(token)

    def process(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """The processors shared by every strategy (transformers' order), on logits or, for beam
        search, log-probabilities [N, V] -> [N, V]."""
        cfg = self.config
        if self.grammar_states is not None:
            logits = self._grammar_masked(logits)
        if self.seen is not None:
            logits = apply_repetition_penalty(logits, self.seen, cfg.repetition_penalty)
        if self.counts is not None:
            logits = apply_presence_frequency_penalty(logits, self.counts, cfg.presence_penalty,
                                                      cfg.frequency_penalty)
        if self.bias is not None:
            logits = logits + self.bias
        if cfg.no_repeat_ngram_size > 0:
            banned = (ban_mask(self.ngrams.ids(logits.shape[-1]), logits.shape[-1])
                      if self.ngrams is not None
                      else no_repeat_ngram_mask(self.history, cfg.no_repeat_ngram_size, logits.shape[-1]))
            logits = logits.masked_fill(banned, float("-inf"))
        if cfg.encoder_no_repeat_ngram_size > 0 and self.sources is not None:
            banned = encoder_no_repeat_ngram_mask(self.sources, self.history, cfg.encoder_no_repeat_ngram_size,
                                                  logits.shape[-1])
            logits = logits.masked_fill(banned, float("-inf"))
        if num_generated < cfg.min_new_tokens and self.eos_ids.numel():
            logits = suppress_tokens(logits, self.eos_ids)
        forced = self._forced(num_generated)
        if forced is not None:
            logits = force_tokens(logits, forced)
        return logits

    def bans_only(self, num_generated: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """When all ``process`` does at this step is set token ids to -inf: (the ids [E] every row bans, E
        may be 0; each row's own [N, W] ids, ``vocab_size`` where none, from no-repeat-n-gram blocking, or
        None), else None: a processor that changes scores in another way is active (beam search's one-pass
        step, layers/beam_search.cpp, serves only the first case)."""
        cfg = self.config
        if (self.seen is not None or self.counts is not None or self.bias is not None
                or self.grammar_states is not None or self._forced(num_generated) is not None):
            return None
        common = self.eos_ids if num_generated < cfg.min_new_tokens else self.eos_ids[:0]
        per_row = []
        if self.ngrams is not None:
            per_row.append(self.ngrams.ids(vocab_size))
        elif cfg.no_repeat_ngram_size > 0:
            per_row.append(no_repeat_ngram_ids(self.history, cfg.no_repeat_ngram_size, vocab_size))
        if self.sources is not None:
            ids = encoder_no_repeat_ngram_ids(self.sources, self.history, cfg.encoder_no_repeat_ngram_size, vocab_size)
            per_row += [ids] if ids is not None else []
        if len(per_row) < 2:
            return common, (per_row[0] if per_row else None)  # [N, W] of the row's n-grams
        return common, torch.cat(per_row, dim=1)  # [N, W1 + W2]

    def plain_greedy(self, num_generated: int) -> bool:
        """True when ``select`` at this step is the argmax of the logits as they are (greedy, no processor
        active), so an engine may pick many such rows with one argmax."""
        cfg = self.config
        return (not cfg.is_sampling and self.seen is None and self.history is None and self.ngrams is None
                and self.counts is None and self.bias is None
                and not (num_generated < cfg.min_new_tokens and self.eos_ids.numel())
                and self.grammar_states is None and self._forced(num_generated) is None)

    def _grammar_masked(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] with every token its row's grammar forbids at -inf (its bias added). A row whose
        matcher allows nothing (it failed: a forced token outside the grammar) may only end."""
        biases = [state.bias() for state in self.grammar_states]
        for row, bias in enumerate(biases):
            if bias is None:
                biases[row] = np.full(logits.shape[-1], np.float32(float("-inf")))
                biases[row][self.eos_ids.tolist()] = 0.0
        if logits.device.type != "cpu":
            return logits + torch.from_numpy(np.stack(biases)).to(logits.device)  # [N, V]
        # numpy, row by row into one new array: torch's ops here measured 2-20 ms a call on 2 busy cores
        values = logits.numpy()
        masked = np.empty_like(values)  # [N, V]
        for row, bias in enumerate(biases):
            np.add(values[row], bias, out=masked[row])
        return torch.from_numpy(masked)

    def _forced(self, num_generated: int) -> torch.Tensor | None:
        """The only token ids allowed at this step (a config's forced BOS / EOS), or None. At a step that
        is both the first and the last, forcing BOS then EOS leaves EOS."""
        cfg = self.config
        if self.forced_eos is not None and cfg.max_new_tokens is not None and num_generated == cfg.max_new_tokens - 1:
            return self.forced_eos
        return self.forced_bos if num_generated == 0 else None

    def select(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """logits [B, V] -> next tokens [B] (long)."""
        cfg = self.config
        logits = self.process(logits.float(), num_generated)
        if cfg.is_sampling:
            if cfg.temperature != 1.0:
                logits = logits / cfg.temperature
            if cfg.top_k:
                logits = apply_top_k(logits, cfg.top_k)
            if cfg.top_p < 1.0:
                logits = apply_top_p(logits, cfg.top_p)
            if cfg.min_p > 0.0:
                logits = apply_min_p(logits, cfg.min_p)
            tokens = sample_rows(logits.softmax(dim=-1), self.generators)
        else:
            tokens = greedy_tokens(logits)
        self.record(tokens)
        return tokens


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> each row's argmax [B] (long): the index ``argmax(dim=-1)`` picks (the first NaN,
    else the first maximum), on the extension's two-pass op for float32 rows on the CPU (PyTorch's
    scalar reduction: 120 us for 49,152 words, 1% of a batch-1 step of SmolLM2-135M)."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu and logits.shape[-1] > 0
            and not torch.compiler.is_compiling() and ops.available()):
        return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def pad_rows(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Token lists -> [N, L] long, left-padded with PAD (built once per generation, not per step)."""
    L = max(len(r) for r in rows)
    out = torch.full((len(rows), L), PAD, dtype=torch.long)
    for index, row in enumerate(rows):
        if row:
            out[index, L - len(row):] = torch.tensor(row, dtype=torch.long)
    return out.to(device)


MASK64 = (1 << 64) - 1


def derive_seed(seed: int, key: int) -> int:
    """A well-mixed 63-bit seed from a base seed and a key (an input line, a return-sequence
    index): SplitMix64's finalizer, so that neighbouring keys give unrelated streams."""
    z = (seed + 0x9E3779B97F4A7C15 * (key + 1)) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def sequence_seeds(config: GenerationConfig, num_prompts: int) -> list[int] | None:
    """Each sequence's seed, prompt by prompt (``num_return_sequences`` each), or None unseeded.

    ``seed`` an int applies to every prompt (as if it ran alone), a list gives one per prompt;
    return sequence j of a prompt seeded p gets ``derive_seed(p, j)``."""
    if config.seed is None:
        return None
    per_prompt = config.seed if isinstance(config.seed, list) else [config.seed] * num_prompts
    if len(per_prompt) != num_prompts:
        raise InvalidOptionError(f"seed has {len(per_prompt)} values for {num_prompts} prompts: give one per prompt")
    return [derive_seed(seed, j) for seed in per_prompt for j in range(config.num_return_sequences)]


def row_generators(seeds: list[int] | None, rows: int, device: torch.device) -> list[torch.Generator]:
    """One generator per row: seeded from ``seeds``, or all from fresh entropy when None."""
    generators = []
    for row in range(rows):
        generator = torch.Generator(device=device)
        if seeds is None:
            generator.seed()
        else:
            generator.manual_seed(seeds[row])
        generators.append(generator)
    return generators


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """probs [N, V] (rows sum to about 1) -> one token per row [N], row i drawn with generators[i].

    One uniform number per row from its own generator (the only per-row loop), then inverse CDF
    for all rows at once: the first token whose cumulative probability exceeds u * total. A token
    of probability 0 is never chosen (the CDF does not rise there).
    """
    uniforms = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])  # [N]
    cdf = probs.cumsum(dim=-1)  # [N, V]
    targets = (uniforms * cdf[:, -1]).unsqueeze(1)  # [N, 1]
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(1)  # [N]
    # u * total can round up to total: then no index qualifies; take the most likely token.
    return torch.where(tokens < probs.shape[-1], tokens, probs.argmax(dim=-1))
