"""The public Python API: ``load``, ``from_hf`` and ``Generator``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import GenerationConfig, ModelConfig
from .errors import GenerationCancelledError, InvalidOptionError
from .engine import Engine
from .engine.call import submit_call
from .engine.requests import RequestFactory
from .engine.sequence import SequenceResult
from .layers.products import KernelChoice
from .generation.loops import loop_results, loop_tokens, runs_in_engine
from .decoding.stopping import TextWatcher, final_text
from .loading.checkpoint import Checkpoint
from .loading.open import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE, default_model_path  # noqa: F401 (public here)
from . import validation

if TYPE_CHECKING:  # pragma: no cover
    from .constraints import CompiledGrammar
    from .generation.chat import ChatSession
    from .pipeline import BatchRun

def load(source: str | Path | None = None, device: str = "cpu", dtype: str = "float32",
         quantize: str | None = None, speculative: Any = None, prompt_rows: str | None = None,
         kernels: KernelChoice | None = None) -> "Generator":
    """quantize: None (GGUF blocks run as they are, float checkpoints stay float), "int8" / "int4"
    (float matrices quantized at load), "dequantize" (GGUF blocks decoded to ``dtype`` at load).
    speculative: the default of the ``speculative`` generation option (e.g. "ngram"), used by
    greedy and sampling calls that do not set it (config/speculative.py).
    prompt_rows / kernels: the model's kernel choice (layers/products.py's ``KernelChoice.at_load``)."""
    from .loading.open import open_checkpoint, save_weight_cache

    choice = KernelChoice.at_load(prompt_rows, kernels)  # a bad value fails before the load
    checkpoint, loaded = open_checkpoint(source, device, dtype, quantize)
    generator = Generator(checkpoint, GenerationConfig.from_options(speculative=speculative), choice)
    save_weight_cache(checkpoint, loaded)
    return generator


def from_hf(hf_model: Any, tokenizer: Any = None, quantize: str | None = None, prompt_rows: str | None = None,
            kernels: KernelChoice | None = None) -> "Generator":
    """quantize: as for ``load`` ("int8" / "int4": the model's float matrices quantized into new tables, the
    model itself untouched; None and "dequantize": its weights shared as they are); prompt_rows /
    kernels: as for ``load``."""
    from .loading.from_hf import checkpoint_from_hf
    from .loading.quantize import apply_quantize, check_quantize

    check_quantize(quantize)
    choice = KernelChoice.at_load(prompt_rows, kernels)
    return Generator(apply_quantize(checkpoint_from_hf(hf_model, tokenizer), quantize), kernels=choice)


def _check_stop(should_stop: Callable[[], bool] | None) -> None:
    if should_stop is not None and should_stop():
        raise GenerationCancelledError("the generation was cancelled by its caller")


class Generator:
    """A model, its tokenizer and default options; every generation entry point lives here.

    A facade: requests are validated and built by ``self.requests`` (engine/requests.py), run by
    the engine (engine/) or, for the strategies it does not run yet, by their decode loops
    (generation/loops.py)."""

    def __init__(self, checkpoint: Checkpoint, defaults: GenerationConfig | None = None,
                 kernels: KernelChoice | None = None):
        """``kernels``: the model's kernel choice (layers/products.py; None: the default one), carried
        by its every forward."""
        self.checkpoint = checkpoint
        self.config: ModelConfig = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.model = checkpoint.family.build(checkpoint.config, checkpoint.weights,
                                                 KernelChoice.at_load(None, kernels))
        self.requests = RequestFactory(self.config, self.tokenizer, defaults, self.model.dtype, self.model.device)

    @property
    def defaults(self) -> GenerationConfig:
        """The options every call starts from (a call's own options override them)."""
        return self.requests.defaults

    @defaults.setter
    def defaults(self, value: GenerationConfig) -> None:
        self.requests.defaults = value

    @property
    def device(self) -> torch.device:
        return self.model.device

    # -- options and inputs -------------------------------------------------------------------
    def compile_constraint(self, response_format: Any, name: str = "response_format",
                           eos_ids: list[int] | None = None) -> "CompiledGrammar | None":
        """A ``response_format`` (constraints/forms.py) compiled for this model, cached by grammar text
        (servers compile on request threads, the engine thread finds it), or None; InvalidOptionError
        naming ``name``."""
        return self.requests.compile_constraint(response_format, name, eos_ids)

    def grammar_for(self, config: GenerationConfig) -> "CompiledGrammar | None":
        """The compiled constraint of a generation config (its ``response_format``), or None."""
        return self.requests.grammar(config)

    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool = False) -> list[int]:
        """Text (or a chat conversation) -> prompt token ids, with the chat template if asked."""
        return self.requests.encode_prompt(prompt, chat)

    # -- the engine ----------------------------------------------------------------------------
    def engine(self, max_batch_tokens: int = 2048, max_queue: int = 256, cache_tokens: int | None = None,
               prefill_chunk: int = 256, source_tokens: int | None = None, compile_decode: bool = False,
               cuda_graphs: bool | None = None) -> Engine:
        """A continuous-batching engine over this model (``submit`` / ``step``; see fastdecode.engine).
        ``prefill_chunk``: prompt tokens per step while other sequences are decoding;
        ``source_tokens``: an encoder-decoder model's cross-attention slots (default: by memory);
        ``compile_decode``: pure-decode steps through the compiled fixed-shape step (engine/compiled.py);
        ``cuda_graphs``: those steps replayed from CUDA graphs (engine/cuda_graphs.py; default on CUDA)."""
        return Engine(self.model, self.requests, max_batch_tokens=max_batch_tokens, max_queue=max_queue,
                      cache_tokens=cache_tokens, prefill_chunk=prefill_chunk, source_tokens=source_tokens,
                      compile_decode=compile_decode, cuda_graphs=cuda_graphs)

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
        prompts = [list(p) for p in validation.token_prompts(prompts)]
        config = self.requests.generation_config(options)
        if config.stop_strings():
            self.requests.require_tokenizer()
        check = lambda: _check_stop(should_stop)  # noqa: E731
        if config.best_of is not None and config.is_sampling and config.best_of > config.num_return_sequences:
            from .generation.best_of import best_of_results

            return best_of_results(self.model, self.requests, prompts, config, check)
        if not runs_in_engine(config):
            return loop_results(self.model, self.requests, prompts, config, check)
        engine, sequences = submit_call(self.model, self.requests, self.requests.build_call(prompts, config))
        while engine.has_work():
            check()
            engine.step()
        return [r for s in sequences for r in (s.group.results if s.group is not None  # a beam search's R results
                                               else [SequenceResult(s.output_ids, s.stop_kind)])]

    def stream_ids(self, token_ids: Sequence[int], **options: Any) -> Iterator[int]:
        token_ids = validation.token_ids(token_ids, "the prompt")
        config = self.requests.generation_config(options)
        if config.num_return_sequences != 1:
            raise InvalidOptionError("stream_ids produces one sequence: num_return_sequences must be 1")
        if config.num_beams > 1:
            raise InvalidOptionError("beam search cannot stream (beams are final only at the end): use generate")
        if not runs_in_engine(config):
            yield from loop_tokens(self.model, self.requests, list(token_ids), config)
            return
        engine, _ = submit_call(self.model, self.requests, self.requests.build_call([token_ids], config))
        while engine.has_work():
            yield from (event.token_id for event in engine.step() if event.token_id is not None)

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
        stops = self.requests.generation_config(options).stop_strings()
        return [final_text(self.tokenizer, r.tokens, stops) for r in results]

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
        cheap appends). ``batch_size``: inputs generating at once in one long-lived engine (or
        ``max_batch_tokens``: their cache tokens); ``lookahead``: the reorder bound. See
        ``fastdecode.pipeline.runner`` for how the stages overlap.
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
        config = self.requests.generation_config(options)
        watcher = TextWatcher(self.requests.require_tokenizer(), config.stop_strings())
        tokens = self.stream_ids(prompt_ids, **dict(options, stop=None))
        try:
            for token in tokens:
                yield token, watcher.push(token)
                if watcher.matcher.stopped:
                    break
            yield None, watcher.finish()
        finally:
            tokens.close()

    # -- scoring -----------------------------------------------------------------------------
    def score(self, text_or_ids: str | Sequence[int], **options: Any) -> list[float]:
        """Per-token negative log-likelihood (nats) of tokens 1..n-1 given the ones before.

        With ``n_ctx`` (and ``n_keep``, ``n_discard``, ``policy``) the text streams through a
        streaming cache of that size, in chunks, as StreamingLLM is evaluated; otherwise the
        whole text must fit in the model's context.
        """
        from .engine.scoring import score_alone

        ids, config = self.requests.build_score(text_or_ids, options)
        return [-logprob for logprob in score_alone(self, ids, config=config).logprobs]  # engine/scoring.py

    def embed(self, inputs: str | Sequence[Any], pooling: str = "mean") -> torch.Tensor:
        """Unit-length embeddings [N, C] (float32) of a text, texts, or token-id lists: the final normed
        hidden states pooled (``mean`` over the tokens or the ``last`` one), run as engine sequences."""
        from .engine.embedding_rows import embed_alone, embedding_inputs

        return embed_alone(self, embedding_inputs(self.requests, inputs), pooling)

    def chat_session(self, system: str | None = None, **options: Any) -> "ChatSession":
        """A multi-turn conversation kept between turns (an engine sequence, then past ``n_ctx`` a
        streaming cache): earlier turns are never prefilled again."""
        from .generation.chat import ChatSession

        return ChatSession(self.model, self.requests, self.requests.build_chat(system, options), system)

    def inspect(self) -> dict[str, Any]:
        from .inspect import describe

        return describe(self)
