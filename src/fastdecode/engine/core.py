"""The engine: ``step()`` = schedule -> run the model -> sample -> update, in the shape of
nano-vllm's ``LLMEngine.step``, over the slot cache with continuous batching.

Each ``step()``:
1. retires cancelled sequences (their blocks are free before anything else runs);
2. the ``Scheduler`` (engine/scheduler.py) picks the work: decodes, prompt chunks, admissions;
3. the ``ModelRunner`` (engine/runner.py) runs ONE model forward over all of it;
4. the ``Sampler`` (engine/sampler.py) chooses one token for every sequence whose step reached its
   last token, each with its own options and generator; finished sequences are released;
5. the scheduler advances the sequences by what ran.

Every strategy is a sequence (or a group of sequences) of this engine: greedy and sampling; beam
search as a group of forked sequences (engine/beam_group.py); streams past ``n_ctx`` as a policy on
a sequence's own blocks (engine/stream_steps.py); scoring as a sequence that keeps every position's
logits (engine/scoring.py); speculative drafts as extra rows to verify (engine/speculative.py).
Encoder-decoder models run the same loop: admission also reserves the sequence's cross-attention
blocks and the runner encodes the sources admitted in a step once (engine/cross.py).

A sequence submitted with ``keep=True`` (a chat session) keeps its blocks when it finishes;
``resume`` continues it with new tokens (only they run), ``drop`` frees it.

One thread owns an Engine (it is not thread-safe); ``Sequence.cancel()`` only sets a flag.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

import torch

from ..config import GenerationConfig
from ..errors import InvalidOptionError, QueueFullError
from ..decoding.sampling import TokenSelector, sequence_seeds
from ..validation import positive_int
from .beam_group import BeamGroup, check_beam_options, folds_beams
from .compiled import CompiledDecode
from .cross import decoder_score_bias
from .plan import layer_windows
from .requests import Request, RequestFactory
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler
from .scoring import finish_scored, scoring_sequence
from .speech_source import cross_store, take_request_extras
from .sequence import Sequence, TokenEvent
from .slots import SlotCache, check_fits
from .speculative import Speculator
from .streaming_policy import new_stream

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
        self.cross = cross_store(model, source_tokens, block_size, DEFAULT_CACHE_BYTES)  # None: decoder-only
        if self.cross is not None:
            self.score_bias = decoder_score_bias(model)
        self.runner = ModelRunner(model, self.cache, self.cross, self.windows, self.score_bias)
        if compile_decode and not cuda_graphs:
            self.runner.compiled = CompiledDecode(self.runner)
        if cuda_graphs:  # the fixed-shape step replayed from CUDA graphs, compiled first if asked
            from .cuda_graphs import CapturedDecode

            self.runner.compiled = CapturedDecode(self.runner, compile_step=compile_decode)
        # The speculator and the sampler hold this engine weakly: no reference cycle, so the engine of a
        # generate call, and its K/V cache (24 MB for a 512-token SmolLM2-135M prompt), is freed when the call
        # returns. In a cycle it lived until the next garbage collection, every 3-4 such calls, and the caches
        # of those calls took fresh memory in turn: page faults, a heap layout that changed from call to call.
        self.speculator = Speculator(self)
        self.scheduler = Scheduler(self.cache, self.cross, max_batch_tokens, prefill_chunk, self.max_chunk,
                                   self.speculator.draft)
        self.sampler = Sampler(self.speculator, self._release)
        self.tokens_run = 0  # tokens the model has run (prefix-cache hits are not run)
        self._ended: list[TokenEvent] = []  # events of sequences that ended outside a forward
        self._next_id = 0

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def compiled(self):
        return self.runner.compiled

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

    def submit_scoring(self, token_ids: list[int], top_logprobs: int = 0, config: GenerationConfig | None = None
                       ) -> Sequence:
        """Queue a text to score (engine/scoring.py): every position's log-probability, no new token
        (``config`` with ``n_ctx``: through a stream of that size)."""
        self.waiting.append(scoring_sequence(self, token_ids, top_logprobs, self._next_id, config))
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
            self.cross.check_fits(prompt if request.source is None else request.source)
            decoder_prompt = request.decoder_prompt or [self.model.config.decoder_start_token_id]
        context = decoder_prompt or prompt
        stream = new_stream(self, config) if config.n_ctx is not None else None  # a stream past n_ctx
        if stream is None:
            check_fits(len(context) + config.max_new_tokens, self.cache,
                       f"a request of {len(context)} prompt tokens", self.max_chunk)
        sequence = self._new_sequence(request, decoder_prompt=decoder_prompt)
        sequence.stream = stream
        if config.num_beams > 1 or request.policy is not None:  # a group of sequences (engine/beam_group.py)
            group = BeamGroup(sequence, list(sequence.eos_ids), request.tokenizer, folds_beams(self.model),
                              request.policy)
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
        take_request_extras(sequence, request)  # an encoded speech window, its prompt logits (speech_source.py)
        self.speculator.attach(sequence)
        self._next_id += 1
        return sequence

    def has_work(self) -> bool:
        return bool(self.scheduler.has_work() or self._ended)

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule, run one forward, sample, update -> this step's events in submission order."""
        events, self._ended = self._ended, []
        events += self.scheduler.retire_cancelled(self._release)
        work = self.scheduler.schedule()
        if work:
            with torch.inference_mode():
                self.speculator.prefill(work)  # draft models read the step's prompt chunks too
                logits, sampled = self.runner.run(work)
            self.tokens_run += sum(count for _, count in work)
            self.scheduler.update(work)
            events += self.sampler.sample(sampled, logits, self.running) + finish_scored(work, self._release)
        self.scheduler.retire_finished()
        return sorted(events, key=lambda event: event.sequence.id)

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
