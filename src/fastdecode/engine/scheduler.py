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
   running sequence never runs out of room and nothing is ever preempted (a model with
   sliding-window layers: full blocks for the full layers, and for each sliding kind a reservation
   of what its window and one chunk need, chunks then capped at ``prefill_chunk``; engine/slots.py);
3. runs ONE model forward over all of it (``StepPlan``);
4. samples one token for every sequence whose step reached its last token, each with its own
   options and generator, and retires the finished ones.

Encoder-decoder models run the same loop: admission also reserves the sequence's cross-attention
blocks and the step runs the encoder over the sources it admitted (engine/cross.py); the
decoder's self-attention uses the slot cache like a decoder-only model's.

A sequence submitted with ``keep=True`` (a chat session) keeps its blocks when it finishes;
``resume`` continues it with new tokens (only they run), ``drop`` frees it.

A sequence submitted with ``n_ctx`` is a stream: its policy (sinks + shift or re-evaluate) runs
before each of its chunks, on its own blocks, in the same steps as everything else
(engine/stream_steps.py).

One thread owns an Engine (it is not thread-safe); ``Sequence.cancel()`` only sets a flag.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from ..errors import InvalidOptionError, QueueFullError
from ..generation.sampling import TokenSelector, sequence_seeds
from ..layers.products import Products
from ..validation import positive_int
from .beam_group import (BeamGroup, advance_groups, check_beam_options, fold_runs, folds_beams, is_beam, lent_spares,
                         whole_groups)
from .compiled import CompiledDecode
from .embedding_rows import forward_outputs
from .cross import CrossStore, decoder_score_bias, row_groups
from .plan import StepPlan, layer_windows
from .requests import Request, RequestFactory
from .layout import flat_layout
from .sampler import sample_rows
from .scoring import finish_scored, keep_logits, scoring_sequence
from .sequence import Sequence, TokenEvent
from .slots import SlotCache, check_fits
from .speculative import Speculator
from .stream_steps import chunk_tokens, mixed_forward, new_stream

DEFAULT_CACHE_BYTES = 1 << 30
WINDOW_SEQUENCES = 16  # sequences a sliding kind's pool serves at their peak at once (shorter ones take less)


class Engine:
    def __init__(self, model: Any, requests: RequestFactory, max_batch_tokens: int = 2048, max_queue: int = 256,
                 cache_tokens: int | None = None, block_size: int = 16, prefill_chunk: int = 256,
                 source_tokens: int | None = None, compile_decode: bool = False, cuda_graphs: bool | None = None):
        """``cache_tokens``: self-attention slots; ``source_tokens``: cross-attention slots of an
        encoder-decoder model (source tokens of the sequences admitted at once); ``compile_decode``:
        run steps where every row decodes one token through the compiled fixed-shape decode step
        (decoder-only models; see engine/compiled.py); ``cuda_graphs``: replay those steps from CUDA
        graphs (engine/cuda_graphs.py; default: on for a decoder-only model on a CUDA device).
        ``requests``: the model's request factory (``submit`` builds its requests)."""
        cfg = model.config
        for name, value in (("max_batch_tokens", max_batch_tokens), ("max_queue", max_queue),
                            ("prefill_chunk", prefill_chunk)):
            positive_int(value, name)
        self.requests, self.model = requests, model
        self.max_batch_tokens, self.max_queue, self.prefill_chunk = max_batch_tokens, max_queue, prefill_chunk
        if cache_tokens is None:
            per_token = cfg.kv_cache_bytes_per_token(model.dtype.itemsize)
            cache_tokens = min(DEFAULT_CACHE_BYTES // per_token, 64 * cfg.max_position_embeddings)
        if cuda_graphs is None:
            cuda_graphs = model.device.type == "cuda" and not cfg.is_encoder_decoder
        if cuda_graphs and (model.device.type != "cuda" or cfg.is_encoder_decoder):
            raise InvalidOptionError("cuda_graphs needs a decoder-only model on a CUDA device")
        if compile_decode and cfg.is_encoder_decoder:
            raise InvalidOptionError("compile_decode is for decoder-only models (the fixed-shape decode step has "
                                     "no cross attention)")
        # a fixed-shape decode step's padding rows write into a scratch block of every kind, on top of
        # the capacity asked for (without it, a cache sized for one request could never admit it)
        scratch = 1 if cuda_graphs or compile_decode else 0
        num_blocks = max(1, -(-cache_tokens // block_size)) + scratch
        self.windows = layer_windows(cfg)
        # A sliding layer needs its window plus one chunk per sequence, not the context: prompt chunks
        # of a model with sliding layers stay within prefill_chunk, which bounds that.
        sliding = [w for w in self.windows if w is not None]
        self.max_chunk = min(max_batch_tokens, prefill_chunk) if sliding else max_batch_tokens
        window_blocks = scratch + min(num_blocks - scratch, WINDOW_SEQUENCES * (
            -(-(max(sliding, default=0) + self.max_chunk - 1) // block_size) + 1))
        self.cache = SlotCache(cfg.num_layers, num_blocks, cfg.num_kv_heads, cfg.head_dim, model.dtype,
                               model.device, block_size, self.windows, window_blocks)
        self.score_bias = model.alibi_bias if cfg.position_kind == "alibi" else None
        self.cross: CrossStore | None = None
        if cfg.is_encoder_decoder:
            if source_tokens is None:
                per_token = cfg.cross_cache_bytes_per_source_token(model.dtype.itemsize)
                source_tokens = min(DEFAULT_CACHE_BYTES // per_token, 64 * cfg.max_position_embeddings)
            self.cross = CrossStore(model, source_tokens, block_size)
            self.score_bias = decoder_score_bias(model)
        self.compiled = CompiledDecode(self) if compile_decode and not cuda_graphs else None
        if cuda_graphs:  # the fixed-shape step replayed from CUDA graphs, compiled first if asked
            from .cuda_graphs import CapturedDecode

            self.compiled = CapturedDecode(self, compile_step=compile_decode)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.tokens_run = 0  # tokens the model has run (prefix-cache hits are not run)
        self._ended: list[TokenEvent] = []  # events of sequences that ended outside a forward
        self._next_id = 0
        self.speculator = Speculator(self)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], options: dict[str, Any] | None = None, keep: bool = False) -> Sequence:
        """Queue a request; raises at once if it can never run or the queue is full (``keep``: see ``add``)."""
        return self.add(self.requests.build(prompt_ids, options), keep)

    def submit_choices(self, prompt_ids: list[int], options: dict[str, Any] | None = None) -> list[Sequence]:
        """``num_return_sequences`` sequences of one prompt, seeded as ``generate`` seeds a prompt's
        choices; all queued or none. No text: the caller detokenizes (the batch pipeline)."""
        options = dict(options or {})
        logprobs = options.pop("logprobs", None)
        config = self.requests.generation_config(options)
        self.requests.check_prompts([list(prompt_ids)], config)
        if len(self.waiting) + config.num_return_sequences > self.max_queue:
            raise QueueFullError(f"the engine's queue is full ({self.max_queue} waiting requests)")
        seeds = sequence_seeds(config, 1) if config.is_sampling else None
        single = dataclasses.replace(config, num_return_sequences=1)
        grammar = self.requests.grammar(config)
        return [self.add(self.requests.request(list(prompt_ids), single, seeds and seeds[j], logprobs, grammar=grammar))
                for j in range(config.num_return_sequences)]

    def submit_scoring(self, token_ids: list[int], top_logprobs: int = 0) -> Sequence:
        """Queue a text to score (engine/scoring.py): every position's log-probability, no new token."""
        self.waiting.append(scoring_sequence(self, token_ids, top_logprobs, self._next_id))
        self._next_id += 1
        return self.waiting[-1]

    def add(self, request: Request, keep: bool = False) -> Sequence:
        """Queue a validated request (``RequestFactory.build`` / ``build_call``). ``keep``: its blocks
        outlive its end (``resume`` / ``drop``)."""
        config, prompt = request.config, request.prompt
        if config.num_beams > 1:
            check_beam_options(request.logprobs, keep)
        if not config.use_cache and config.n_ctx is None:  # (a stream has its cache whatever use_cache says)
            raise InvalidOptionError("the engine runs cached generation: use_cache=False runs through "
                                     "Generator.generate")
        if config.num_return_sequences != 1 and config.num_beams == 1:
            raise InvalidOptionError("submit one request per wanted sequence (num_return_sequences must be 1)")
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the engine's queue is full ({self.max_queue} waiting requests)")
        decoder_prompt = None
        if self.cross is not None:
            if keep:
                raise InvalidOptionError("an encoder-decoder request cannot be kept between turns (no chat)")
            self.cross.check_fits(prompt)
            decoder_prompt = [self.model.config.decoder_start_token_id]
        context = decoder_prompt or prompt
        stream = new_stream(self, config) if config.n_ctx is not None else None  # a stream past n_ctx
        if stream is None:
            check_fits(len(context) + config.max_new_tokens, self.cache,
                       f"a request of {len(context)} prompt tokens", self.max_chunk)
        sequence = self._new_sequence(request, decoder_prompt=decoder_prompt)
        sequence.stream = stream
        if config.num_beams > 1:  # a beam search: a group of sequences (engine/beam_group.py)
            group = BeamGroup(sequence, list(sequence.eos_ids), request.tokenizer, folds_beams(self.model))
            group.check_fits(self.cache, self.max_chunk)
        sequence.keep_cache = keep
        self._queue(sequence)
        return sequence

    def _queue(self, sequence: Sequence) -> None:
        if sequence.config.max_new_tokens == 0:
            self._ended.append(sequence.end_event("length"))
        else:
            self.waiting.append(sequence)

    def resume(self, kept: Sequence, request: Request) -> Sequence:
        """Continue a finished kept sequence (a chat session's next turn) with ``request``, whose
        prompt is the turn's new tokens: the kept tokens plus those are the new sequence's prompt,
        the K/V already computed stay in its blocks and only the rest runs. The processors see the
        tokens this turn feeds (the old last token and the new ones), as a streaming cache
        continuing a conversation does. ``kept`` is spent."""
        if not (kept.keep_cache and kept.finished and kept.source is None):
            raise InvalidOptionError("only a finished sequence submitted with keep=True can be resumed")
        prompt = kept.tokens(0, kept.num_tokens) + list(request.prompt)
        if request.config.n_ctx is None and kept.stream is None:
            check_fits(len(prompt) + request.config.max_new_tokens, self.cache,
                       f"a conversation of {len(prompt)} tokens", self.max_chunk)
        elif kept.stream is None:
            raise InvalidOptionError("a conversation kept without n_ctx cannot go on as a stream")
        fed = prompt[kept.num_computed:]
        sequence = self._new_sequence(dataclasses.replace(request, prompt=prompt), history=fed)
        sequence.keep_cache = True
        sequence.stream, kept.stream = kept.stream, None
        sequence.block_table, kept.block_table = kept.block_table, []
        sequence.block_hashes, sequence.num_computed = kept.block_hashes, kept.num_computed
        sequence.num_cached_prompt_tokens = kept.num_computed
        self._queue(sequence)
        return sequence

    def drop(self, sequence: Sequence) -> None:
        """Free a kept sequence's blocks (it must have finished)."""
        sequence.keep_cache = False
        self._release(sequence)

    def _new_sequence(self, request: Request, decoder_prompt: list[int] | None = None,
                      history: list[int] | None = None) -> Sequence:
        model, config, prompt = self.model, request.config, request.prompt
        selector = TokenSelector(config, request.eos_ids, model.config.vocab_size, model.device,
                                 forced_bos=getattr(model.config, "forced_bos_token_id", None),
                                 forced_eos=getattr(model.config, "forced_eos_token_id", ()),
                                 grammar=request.grammar)
        # The processors' history: the decoder's tokens (an encoder-decoder's start token, as
        # transformers penalizes it), and the source for encoder n-gram blocking.
        history = history if history is not None else decoder_prompt or prompt
        selector.start([history], model.device, sources=None if decoder_prompt is None else [prompt],
                       row_seeds=None if request.seed is None else [request.seed])
        sequence = Sequence(self._next_id, prompt, config, selector, request.eos_ids, request.text_watcher(),
                            request.logprobs, decoder_prompt)
        self.speculator.attach(sequence)
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
                if self.cross is not None:
                    self.cross.encode_pending()  # the sources admitted this step, once each
                events += self._run(work)
        self.running = [s for s in self.running if not s.finished]
        return sorted(events, key=lambda event: event.sequence.id)

    def _retire_cancelled(self) -> list[TokenEvent]:
        events = []
        for sequence in [s for s in (*self.running, *self.waiting) if s.cancel_requested]:
            events.append(sequence.end_event("cancelled"))
            self._release(sequence)
        self.running = [s for s in self.running if not s.finished]
        self.waiting = deque(s for s in self.waiting if not s.finished)
        return events

    def _schedule(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to run) for this step: decodes first, then prompt chunks, then admissions."""
        decoding = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        reading = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        decoding = whole_groups(decoding, self.max_batch_tokens)  # a beam group's beams run together
        self.speculator.draft(decoding)  # engine/speculative.py
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
            work.append((sequence, count))
            budget, untouched = max(0, budget - count), False
        while self.waiting and budget > 0:
            sequence = self.waiting[0]
            if not self._admit(sequence):
                break  # FIFO: the head waits for room, nobody overtakes it
            self.waiting.popleft()
            self.running.append(sequence)
            count = chunk_tokens(sequence, budget, untouched, self.max_chunk)
            if count:
                work.append((sequence, count))
                budget, untouched = max(0, budget - count), False
        return work

    def _admit(self, sequence: Sequence) -> bool:
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

    def _run(self, work: list[tuple[Sequence, int]]) -> list[TokenEvent]:
        with lent_spares(work):  # beam groups write within the blocks they hold in reserve
            for sequence, count in work:  # sliding kinds: drop what slid out, take the blocks written now
                if sequence.stream is None:
                    self.cache.prepare(sequence.block_table, sequence.num_computed, sequence.num_computed + count)
        if any(sequence.stream is not None for sequence, _ in work):
            logits, sampled = mixed_forward(self, work)
        elif self.compiled is not None and all(count == 1 and s.num_computed >= len(s.context) for s, count in work):
            sampled = [sequence for sequence, _ in work]  # every row decodes its last token
            logits = self.compiled.logits(sampled)  # [B, V]
        else:
            logits, sampled = self._forward(work)
        self.tokens_run += sum(count for _, count in work)
        for sequence, count in work:
            if not sequence.draft:  # a verified draft advances by what is accepted (Speculator.sample)
                self._computed(sequence, sequence.num_computed + count)
        return self._sample(sampled, logits) + finish_scored(work, self._release)

    def _forward(self, work: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """One flat varlen forward over ``work`` (engine/layout.py) -> (logits [K, V], the sequences that
        reached their last token, in logits order: one row each, 1 + its draft's length for a verifying one)."""
        device = self.model.device
        layout = flat_layout(work)  # engine/layout.py
        groups = row_groups([(s, count) for s, _, count in layout.rows])
        runs = fold_runs([(s, count) for s, _, count in layout.rows])  # FastSeq: beams folded on their prompt
        # a row's arithmetic follows its role (layers/products.py); big ops get the caller's threads
        products = Products.of_rows(layout.is_prompt, torch.get_num_threads(), device)
        plan = StepPlan.for_rows(self.cache, [(s.block_table, start, count) for s, start, count in layout.rows],
                                 self.windows, self.score_bias, self.model.dtype, products, runs=runs)
        token_tensor = torch.tensor([layout.tokens], device=device)  # [1, N]
        position_tensor = torch.tensor([layout.positions], device=device)  # [1, N]
        logits_at = torch.tensor(layout.logits_at, dtype=torch.long, device=device)
        if self.cross is None:
            logits = forward_outputs(self.model, token_tensor, position_tensor, plan, logits_at, layout)  # [K, V]
        else:
            logits = self.model.decode(token_tensor, position_tensor, plan, None, self.cross.step(groups),
                                       logits_at=logits_at)[0]  # [K, V]
        return keep_logits(layout.scored, logits, len(layout.logit_rows)), layout.sampled  # scoring rows handed over

    def _computed(self, sequence: Sequence, num_computed: int) -> None:
        """Advance a sequence and name its newly completed blocks for the prefix cache."""
        pool = self.cache.pool
        done_before, sequence.num_computed = sequence.num_computed // pool.block_size, num_computed
        done_now = num_computed // pool.block_size
        # unnamed: encoder-decoder K/V depend on the source, a stream's positions move, beams swap blocks
        if done_now > done_before and sequence.source is None and sequence.stream is None and not is_beam(sequence):
            self.cache.publish(sequence.block_table, sequence.tokens(0, num_computed), sequence.block_hashes,
                               done_now)

    def _sample(self, sampled: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        events = []
        if any(s.group is not None for s in sampled):  # beam groups' rows go to their policy (beam_group.py)
            sampled, logits, events = advance_groups(sampled, logits, self.running, self._release)
        if any(s.draft for s in sampled):  # verifying sequences keep what their rows confirm
            return events + self.speculator.sample(sampled, logits)
        return events + self._sample_rows(sampled, logits)

    def _sample_rows(self, sampled: list[Sequence], logits: torch.Tensor) -> list[TokenEvent]:
        return sample_rows(sampled, logits, self._release)  # engine/sampler.py

    def _release(self, sequence: Sequence) -> None:
        if sequence.group is not None:
            sequence.group.release()  # its beams, spare blocks and reservations
        self.speculator.release(sequence)
        if self.cross is not None:
            self.cross.release(sequence)
        if sequence.stream is not None and not sequence.keep_cache:
            sequence.stream.release()
        if sequence.block_table and not sequence.keep_cache:
            self.cache.release(sequence.block_table)
            sequence.block_table = []
