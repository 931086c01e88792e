"""The engine: a step scheduler with continuous batching over the slot cache.

Each ``step()``:
1. retires cancelled sequences (their blocks are free before anything else runs);
2. picks work within ``max_batch_tokens``: one token for every running sequence that is
   decoding, then the next chunk of every running sequence still reading its prompt, then
   admits waiting sequences in FIFO order while the budget and the free blocks allow. While any
   sequence is decoding, the prompt chunks of a step total at most ``prefill_chunk`` tokens
   (Sarathi-Serve's stall-free batching): a long prompt then costs the decoding sequences a few
   slightly longer steps instead of one long one, which bounds their per-token latency; with
   nobody decoding, prompts get the whole budget (the fastest first token). A sequence reserves
   blocks for its prompt and all its new tokens at admission, sharing any cached prefix, so a
   running sequence never runs out of room and nothing is ever preempted;
3. runs ONE model forward over all of it (``StepPlan``);
4. samples one token for every sequence whose step reached its last token, each with its own
   options and generator, and retires the finished ones.

One thread owns an Engine (it is not thread-safe); ``Sequence.cancel()`` only sets a flag.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from ..config import GenerationConfig
from ..errors import InvalidOptionError, QueueFullError, UnsupportedModelError
from ..generation.sampling import TokenSelector, sequence_seeds
from .plan import AttentionGroup, StepPlan, layer_windows
from .sequence import Sequence, TokenEvent, token_logprobs
from .slots import SlotCache, check_fits

DEFAULT_CACHE_BYTES = 1 << 30


class Engine:
    def __init__(self, generator: Any, max_batch_tokens: int = 2048, max_queue: int = 256,
                 cache_tokens: int | None = None, block_size: int = 16, prefill_chunk: int = 256):
        model = generator.model
        cfg = model.config
        if cfg.is_encoder_decoder:
            raise UnsupportedModelError("the engine serves decoder-only models; encoder-decoder models run "
                                        "through Generator.generate")
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise InvalidOptionError(f"max_batch_tokens must be an integer >= 1, got {max_batch_tokens!r}")
        if not isinstance(max_queue, int) or max_queue < 1:
            raise InvalidOptionError(f"max_queue must be an integer >= 1, got {max_queue!r}")
        if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
            raise InvalidOptionError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
        self.generator, self.model = generator, model
        self.max_batch_tokens, self.max_queue, self.prefill_chunk = max_batch_tokens, max_queue, prefill_chunk
        if cache_tokens is None:
            per_token = cfg.kv_cache_bytes_per_token(model.dtype.itemsize)
            cache_tokens = min(DEFAULT_CACHE_BYTES // per_token, 64 * cfg.max_position_embeddings)
        num_blocks = max(1, -(-cache_tokens // block_size))
        self.cache = SlotCache(cfg.num_layers, num_blocks, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                               model.device, block_size)
        self.windows = layer_windows(cfg)
        self.score_bias = model.alibi_bias if cfg.position_kind == "alibi" else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.tokens_run = 0  # tokens the model has run (prefix-cache hits are not run)
        self._ended: list[TokenEvent] = []  # events of sequences that ended outside a forward
        self._next_id = 0

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], options: dict[str, Any] | None = None) -> Sequence:
        """Queue a request; raises at once if it can never run or the queue is full."""
        options = dict(options or {})
        logprobs = options.pop("logprobs", None)
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
            raise InvalidOptionError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
        config = self.generator._options(options)
        prompt = list(prompt_ids)
        self.generator._check_prompts([prompt], config)
        seeds = sequence_seeds(config, 1) if config.is_sampling else None  # as generate([prompt], seed=...)
        return self.add(prompt, dataclasses.replace(config, seed=None), seeds and seeds[0],
                        detokenize=self.generator.tokenizer is not None, logprobs=logprobs)

    def add(self, prompt: list[int], config: GenerationConfig, seed: int | None, detokenize: bool = False,
            logprobs: int | None = None) -> Sequence:
        """Queue a validated request (the Generator validates a whole call at once). ``seed``: the
        sequence's own sampling seed (None: fresh entropy)."""
        if config.num_beams > 1:
            raise InvalidOptionError("beam search (num_beams > 1) does not run in the engine: use "
                                     "Generator.generate_ids_with_details")
        if config.n_ctx is not None or not config.use_cache:
            raise InvalidOptionError("the engine runs cached generation: streaming (n_ctx) and use_cache=False "
                                     "run through Generator.generate")
        if config.num_return_sequences != 1:
            raise InvalidOptionError("submit one request per wanted sequence (num_return_sequences must be 1)")
        if logprobs is not None and logprobs > self.model.config.vocab_size:
            raise InvalidOptionError(f"logprobs={logprobs} exceeds the vocabulary size {self.model.config.vocab_size}")
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the engine's queue is full ({self.max_queue} waiting requests)")
        check_fits(len(prompt) + config.max_new_tokens, self.cache, f"a request of {len(prompt)} prompt tokens")
        sequence = self._new_sequence(prompt, config, seed, detokenize, logprobs)
        if config.max_new_tokens == 0:
            self._ended.append(sequence.end_event("length"))
        else:
            self.waiting.append(sequence)
        return sequence

    def _new_sequence(self, prompt, config, seed, detokenize, logprobs) -> Sequence:
        gen, model = self.generator, self.model
        eos = gen._eos_ids(config)
        selector = TokenSelector(config, eos, model.config.vocab_size, model.device)
        selector.start([prompt], model.device, row_seeds=None if seed is None else [seed])
        watcher = None
        if detokenize or config.stop_strings():
            from ..generation.stopping import TextWatcher

            watcher = TextWatcher(gen._require_tokenizer(), config.stop_strings())
        sequence = Sequence(self._next_id, prompt, config, selector, eos, watcher, logprobs)
        self._next_id += 1
        return sequence

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._ended)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Admit, run one forward, sample, retire -> this step's events in submission order."""
        events, self._ended = self._ended, []
        events += self._retire_cancelled()
        work = self._schedule()
        if work:
            with torch.inference_mode():
                events += self._run(work)
        self.running = [s for s in self.running if not s.finished]
        return sorted(events, key=lambda event: event.sequence.id)

    def _retire_cancelled(self) -> list[TokenEvent]:
        events = []
        for sequence in [s for s in self.running if s.cancel_requested] + [s for s in self.waiting
                                                                             if s.cancel_requested]:
            events.append(sequence.end_event("cancelled"))
            self._release(sequence)
        self.running = [s for s in self.running if not s.finished]
        self.waiting = deque(s for s in self.waiting if not s.finished)
        return events

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to run) for this step: decodes first, then prompt chunks, then admissions."""
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        reading = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        work = [(sequence, 1) for sequence in decoding[: self.max_batch_tokens]]
        budget = self.max_batch_tokens - len(work)
        if work:
            budget = min(budget, self.prefill_chunk)  # prompt tokens this step (see the module docstring)
        for sequence in reading:
            count = min(sequence.num_tokens - sequence.num_computed, budget)
            if count == 0:
                break
            work.append((sequence, count))
            budget -= count
        pool = self.cache.pool
        while self.waiting and budget > 0:
            sequence = self.waiting[0]
            if not pool.can_allocate(sequence.prompt_ids, sequence.total_tokens):
                break  # FIFO: the head waits for room, nobody overtakes it
            self.waiting.popleft()
            table, cached = pool.allocate(sequence.prompt_ids, sequence.total_tokens)
            sequence.block_table, sequence.num_computed = table, cached
            sequence.num_cached_prompt_tokens = cached
            sequence.block_hashes = pool.chain(sequence.prompt_ids, cached // pool.block_size)
            self.running.append(sequence)
            count = min(sequence.num_tokens - cached, budget)
            work.append((sequence, count))
            budget -= count
        return work

    def _run(self, work: list[tuple[Sequence, int]]) -> list[TokenEvent]:
        device = self.model.device
        work = [w for w in work if w[1] == 1] + [w for w in work if w[1] > 1]  # one-query rows first
        tokens, positions, slots, logit_rows, sampled = [], [], [], [], []
        for sequence, count in work:
            start = sequence.num_computed
            tokens += sequence.tokens(start, start + count)
            positions += range(start, start + count)
            slots += self.cache.slot_ids(sequence.block_table, start, start + count)
            if start + count == sequence.num_tokens:
                logit_rows.append(len(tokens) - 1)
                sampled.append(sequence)
        plan = StepPlan(self.cache, torch.tensor(slots, device=device), self._groups(work), self.windows,
                        self.score_bias, self.model.dtype)
        token_tensor = torch.tensor([tokens], device=device)  # [1, N]
        position_tensor = torch.tensor([positions], device=device)  # [1, N]
        logits = self.model.forward(token_tensor, position_tensor, plan, None,
                                    logits_at=torch.tensor(logit_rows, dtype=torch.long, device=device))[0]  # [K, V]
        self.tokens_run += len(tokens)
        for sequence, count in work:
            self._computed(sequence, sequence.num_computed + count)
        return self._sample(sampled, logits)

    def _groups(self, work: list[tuple[Sequence, int]]) -> list[AttentionGroup]:
        """One group for all one-query rows, one per longer chunk (``work`` is in that order)."""
        device = self.model.device
        singles = [s for s, count in work if count == 1]
        groups, first = [], 0
        if singles:
            ends = [s.num_computed + 1 for s in singles]
            groups.append(self._group(first, [s.block_table for s in singles], max(ends), 1,
                                      torch.tensor(ends, device=device)[:, None] - 1))
            first += len(singles)
        for sequence, count in work[len(singles):]:
            end = sequence.num_computed + count
            query_positions = torch.arange(sequence.num_computed, end, device=device)[None]  # [1, T]
            groups.append(self._group(first, [sequence.block_table], end, count, query_positions))
            first += count
        return groups

    def _group(self, first: int, tables: list[list[int]], num_keys: int, queries: int,
               query_positions: torch.Tensor) -> AttentionGroup:
        block_table = self.cache.block_tables(tables, self.cache.pool.blocks_for(num_keys))
        return AttentionGroup(first, len(tables), queries, block_table, query_positions)

    def _computed(self, sequence: Sequence, num_computed: int) -> None:
        """Advance a sequence and name its newly completed blocks for the prefix cache."""
        pool = self.cache.pool
        done_before, sequence.num_computed = sequence.num_computed // pool.block_size, num_computed
        done_now = num_computed // pool.block_size
        if done_now > done_before:
            pool.publish(sequence.block_table, sequence.tokens(0, num_computed), sequence.block_hashes, done_now)

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        if not sampled:
            return []
        chosen = torch.cat([s.selector.select(logits[i : i + 1], len(s.output_ids)) for i, s in enumerate(sampled)])
        token_ids = chosen.tolist()  # the one host sync of the step
        wanted = [i for i, s in enumerate(sampled) if s.logprobs is not None]
        details: dict[int, tuple[float, list]] = {}
        if wanted:
            rows = torch.tensor(wanted, device=logits.device)
            top = max(sampled[i].logprobs for i in wanted)
            chosen_lp, tops = token_logprobs(logits[rows], chosen[rows], top)
            for j, i in enumerate(wanted):
                details[i] = (chosen_lp[j], tops[j][: sampled[i].logprobs] if sampled[i].logprobs else None)
        events = []
        for i, (sequence, token) in enumerate(zip(sampled, token_ids)):
            logprob, top_logprobs = details.get(i, (None, None))
            events.append(sequence.accept(token, logprob, top_logprobs))
            if sequence.finished:
                self._release(sequence)
        return events

    def _release(self, sequence: Sequence) -> None:
        if sequence.block_table:
            self.cache.pool.release(sequence.block_table)
            sequence.block_table = []
