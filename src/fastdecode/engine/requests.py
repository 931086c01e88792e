"""Requests: from a caller's prompt and options to what a sequence is built from.

``RequestFactory(model_config, tokenizer, defaults, dtype, device)`` holds everything a request
needs to know about the model that is not the network itself: the default options, the
tokenizer, the end-of-sequence ids, the compiled grammars and the memory limits. ``build`` turns
token ids and an options dict into a validated ``Request`` (what ``Engine.submit`` does before a
sequence exists); ``build_call`` does the same for a whole call (every prompt checked, the
memory the call implies checked, ``num_return_sequences`` requests per prompt, each with its own
seed). The public ``Generator``, the engine, chat sessions and the server all go through one
factory, so an option means the same thing on every path; nothing below the API holds a
``Generator``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..config import GenerationConfig, ModelConfig
from ..errors import InvalidOptionError, TokenizerError
from ..decoding.sampling import sequence_seeds
from ..decoding.stopping import TextWatcher
from ..memory import check_request_memory
from ..prompt_checks import check_prompts
from .. import validation

if TYPE_CHECKING:  # pragma: no cover
    from ..constraints import CompiledGrammar, ModelGrammars
    from ..layers.products import KernelChoice


@dataclass
class Request:
    """One sequence to generate: its prompt (an encoder-decoder model's source), validated options
    for exactly one sequence (``num_return_sequences`` 1, the seed already resolved into ``seed``),
    the ids that end it, its grammar, and what its events carry."""

    prompt: list[int]
    config: GenerationConfig
    seed: int | None  # the sequence's own sampling seed (None: fresh entropy)
    eos_ids: list[int]
    grammar: "CompiledGrammar | None" = None
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and the top k
    tokenizer: Any = None  # set when the events carry text or stop strings must be watched
    # An encoder-decoder request whose source is not token ids (a speech window already encoded:
    # engine/speech_source.py): then ``prompt`` is what the decoder runs first.
    source: Any = None
    # A request decoded as a group of ``config.num_beams`` rows whose choice is this policy (the
    # ``advance`` / ``results`` of engine/beam_scores.py's ``BeamScores``, the default for beam search).
    policy: Any = None
    prompt_logits_at: int | None = None  # a decoder prompt position whose logits the sequence keeps

    @property
    def decoder_prompt(self) -> list[int] | None:
        """What an encoder-decoder request's decoder runs first when it is not the start token."""
        return self.prompt if self.source is not None else None

    def text_watcher(self) -> TextWatcher | None:
        """The watcher that turns this request's tokens into text and finds its stop strings, or None."""
        if self.tokenizer is None:
            return None
        return TextWatcher(self.tokenizer, self.config.stop_strings())


def check_logprobs(logprobs: Any, vocab_size: int) -> int | None:
    """``logprobs``: None, or an integer in [0, vocab_size] -> itself; InvalidOptionError otherwise."""
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0):
        raise InvalidOptionError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
    if logprobs is not None and logprobs > vocab_size:
        raise InvalidOptionError(f"logprobs={logprobs} exceeds the vocabulary size {vocab_size}")
    return logprobs


class RequestFactory:
    """Validated requests for one model: options merged over ``defaults``, prompts checked against
    the model's vocabulary and context, memory checked, eos ids, seeds, stop strings and grammars
    resolved. ``dtype`` / ``device``: the model's (the memory a request implies depends on them)."""

    def __init__(self, model_config: ModelConfig, tokenizer: Any, defaults: GenerationConfig | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.defaults = defaults or GenerationConfig()
        self.dtype, self.device = dtype, torch.device(device)
        self._grammars: "ModelGrammars | None" = None  # made at the first constraint
        self._draft_models: dict[str, Any] = {}  # path -> engine/draft_model.py's DraftModel, loaded once

    # -- options ---------------------------------------------------------------------------------
    def generation_config(self, options: dict[str, Any]) -> GenerationConfig:
        """``options`` (Hugging Face / fastdecode names) over the defaults, validated."""
        return GenerationConfig.from_options(self.defaults, **options)

    def eos_ids(self, config: GenerationConfig) -> list[int]:
        """The ids that end a sequence: the explicit ``eos_token_id``, else the model's and its
        tokenizer's; none with ``ignore_eos`` (then only max_new_tokens and stop strings end it)."""
        if config.ignore_eos:
            return []
        explicit = config.eos_token_ids_or_none()
        if explicit is not None:
            outside = [t for t in explicit if t >= self.model_config.vocab_size]
            if outside:  # a token the model can never produce would never end anything
                raise InvalidOptionError(f"eos_token_id names token id {outside[0]}, past the vocabulary "
                                         f"({self.model_config.vocab_size} tokens)")
            return explicit
        ids = list(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids += [i for i in self.tokenizer.eos_token_ids if i not in ids]
        return ids

    def require_tokenizer(self) -> Any:
        """The tokenizer; TokenizerError when the model has none."""
        if self.tokenizer is None:
            raise TokenizerError(
                "this model has no tokenizer: pass token ids to generate_ids / stream_ids, "
                "or give a tokenizer (tokenizer.json in the folder, or from_hf(model, tokenizer))"
            )
        return self.tokenizer

    def compile_constraint(self, response_format: Any, name: str = "response_format",
                           eos_ids: list[int] | None = None) -> "CompiledGrammar | None":
        """A ``response_format`` (constraints/forms.py) compiled for this model, cached by grammar text
        (servers compile on request threads, the engine thread finds it), or None; InvalidOptionError
        naming ``name``."""
        if response_format is None:  # no constraint: nothing to build (a model without a tokenizer is fine)
            return None
        if self._grammars is None:
            from ..constraints import ModelGrammars

            self._grammars = ModelGrammars(self.require_tokenizer(), self.model_config.vocab_size)
        eos = self.eos_ids(self.defaults) if eos_ids is None else eos_ids
        return self._grammars.compile(response_format, name, eos)

    def draft_model(self, path: str, kernels: KernelChoice) -> Any:
        """The draft model at ``path`` (loaded once, on this model's device and dtype, with the kernel
        choice ``kernels``: the target model's, its prompt rows on the int8 kernels: a draft's
        arithmetic never changes the output, only how fast its prompt is read), checked to share
        this model's tokenizer (engine/draft_model.py)."""
        if path not in self._draft_models:
            from ..loading.open import open_checkpoint
            from .draft_model import DraftModel, check_draft_compatible

            checkpoint, _ = open_checkpoint(path, str(self.device), str(self.dtype).removeprefix("torch."), None)
            model = checkpoint.family.build(checkpoint.config, checkpoint.weights,
                                            dataclasses.replace(kernels, prompt_rows="int8"))
            requests = RequestFactory(checkpoint.config, checkpoint.tokenizer, dtype=self.dtype, device=self.device)
            check_draft_compatible(path, self, requests)
            self._draft_models[path] = DraftModel(model, requests, path)
        return self._draft_models[path]

    def grammar(self, config: GenerationConfig) -> "CompiledGrammar | None":
        """The compiled constraint of a generation config (its ``response_format``), or None."""
        return self.compile_constraint(config.response_format, eos_ids=self.eos_ids(config))

    # -- prompts ---------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[dict[str, str]], chat: bool = False) -> list[int]:
        """Text (or a chat conversation) -> prompt token ids, with the chat template if asked."""
        prompt = validation.check_prompt(prompt)
        tokenizer = self.require_tokenizer()
        if (isinstance(prompt, list) or chat) and self.model_config.is_encoder_decoder:
            raise InvalidOptionError("chat templates are for decoder-only models; give an encoder-decoder "
                                     "model the source text itself")
        if isinstance(prompt, list) or chat:
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return tokenizer.encode(text, add_special_tokens=False)
        if not isinstance(prompt, str):
            raise InvalidOptionError(f"a prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
        return tokenizer.encode(prompt, add_special_tokens=True)

    def check_prompts(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """Prompts a generation with ``config`` can run (prompt_checks.py)."""
        check_prompts(self.model_config, prompts, config)

    def check_memory(self, prompts: list[list[int]], config: GenerationConfig) -> None:
        """MemoryLimitError when running these prompts at once would pass the memory limit (memory.py)."""
        check_request_memory(self.model_config, config, [len(p) for p in prompts], self.dtype.itemsize, self.device)

    def check_call(self, prompts: Sequence[Sequence[int]], config: GenerationConfig) -> list[list[int]]:
        """A whole call's prompts as lists, checked (tokens, lengths, memory of running them at once)."""
        prompts = [list(p) for p in prompts]
        self.check_prompts(prompts, config)
        self.check_memory(prompts, config)
        return prompts

    # -- requests --------------------------------------------------------------------------------
    def build(self, prompt_ids: Sequence[int], options: dict[str, Any] | None = None) -> Request:
        """One request from token ids and an options dict (``logprobs`` among them), as
        ``Engine.submit`` takes it; its events carry text when the model has a tokenizer. A seed
        gives the sequence ``generate([prompt], seed=...)`` would give it."""
        options = dict(options or {})
        logprobs = check_logprobs(options.pop("logprobs", None), self.model_config.vocab_size)
        config = self.generation_config(options)
        prompt = list(prompt_ids)
        self.check_prompts([prompt], config)
        seeds = sequence_seeds(config, 1) if config.is_sampling else None
        return self.request(prompt, config, seeds and seeds[0], logprobs=logprobs,
                            detokenize=self.tokenizer is not None)

    def request(self, prompt: list[int], config: GenerationConfig, seed: int | None, logprobs: int | None = None,
                detokenize: bool = False, grammar: Any = None) -> Request:
        """A request from a config already validated (a call's, a chat session's): eos ids, grammar
        (``grammar``: one compiled already for this config) and the text watcher resolved."""
        logprobs = check_logprobs(logprobs, self.model_config.vocab_size)
        stops = config.stop_strings()
        return Request(list(prompt), dataclasses.replace(config, seed=None), seed, self.eos_ids(config),
                       grammar if grammar is not None else self.grammar(config), logprobs,
                       self.require_tokenizer() if detokenize or stops else None)

    def build_call(self, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                   logprobs: int | None = None) -> list[Request]:
        """Every request of a call (``num_return_sequences`` per prompt, prompt by prompt), after
        ``check_call``; each sequence samples with its own seed (``sequence_seeds``: the same for a
        prompt alone or in a batch)."""
        prompts = self.check_call(prompts, config)
        seeds = sequence_seeds(config, len(prompts)) if config.is_sampling else None
        grammar = self.grammar(config)
        if config.num_beams > 1:  # one beam group per prompt gives its num_return_sequences results
            return [self.request(p, config, None, logprobs, grammar=grammar) for p in prompts]
        single = dataclasses.replace(config, num_return_sequences=1)
        repeated = [p for p in prompts for _ in range(config.num_return_sequences)]
        return [self.request(p, single, seeds and seeds[i], logprobs, grammar=grammar) for i, p in enumerate(repeated)]

    def build_score(self, text_or_ids: Any, options: dict[str, Any]) -> tuple[list[int], GenerationConfig]:
        """What ``score`` runs: the token ids (text encoded) and its config (no new tokens),
        checked; InvalidOptionError for an encoder-decoder model or fewer than two tokens."""
        if self.model_config.is_encoder_decoder:
            raise InvalidOptionError("score is for decoder-only models (an encoder-decoder model needs a source)")
        value = validation.score_input(text_or_ids)
        ids = value if not isinstance(value, str) else self.require_tokenizer().encode(value)
        config = self.generation_config(options)
        if len(ids) < 2:
            raise InvalidOptionError("score needs at least two tokens")
        config = GenerationConfig.from_options(config, max_new_tokens=0)
        self.check_prompts([ids], config)
        self.check_memory([ids if config.n_ctx is None else ids[:1]], config)
        return ids, config

    def build_chat(self, system: str | None, options: dict[str, Any]) -> GenerationConfig:
        """A chat session's config (``n_ctx`` None or absent: the default size), its system message
        and memory checked."""
        if system is not None:
            validation.check_text(system, "the system message")
        options = dict(options)
        if options.get("n_ctx") is None:
            options["n_ctx"] = min(self.model_config.max_position_embeddings, 4096)
        config = self.generation_config(options)
        self.check_memory([[0]], config)
        return config


__all__ = ["Request", "RequestFactory", "check_logprobs"]
