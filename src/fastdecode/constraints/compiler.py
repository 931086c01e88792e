"""Grammars compiled against a model's tokenizer, cached by their text, and per-row matcher states.

llguidance computes, from a grammar and the tokens so far, the set of tokens that keep the
output inside the grammar (a bitmask over the vocabulary). ``GrammarCompiler`` owns the
llguidance tokenizer (built once from the ``tokenizers`` JSON, ~0.4 s) and a cache of compiled
grammars keyed by their text, so a schema sent a thousand times compiles once; compiling is
bounded by llguidance's parser limits (lexer fuel, grammar size), so a hostile grammar fails
with an error instead of stalling. ``GrammarState`` is one row's position in its grammar: its
allowed-token mask, the token it took, and a fork for beam search.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from ..errors import InvalidOptionError

CACHE_ENTRIES = 256
# BYTE_BIAS[byte] = the 8 tokens' biases of one mask byte: bit i set -> 0, clear -> -inf (low bit first).
BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)  # [256, 8]
# llguidance's own defaults, named here so that the bounds are a decision, not an accident:
# initial lexer fuel ~20 ms of regex analysis, at most 500k grammar symbols, a mask step at most
# 200k lexer fuel (~15 ms) and 50k Earley items.
PARSER_LIMITS = {"initial_lexer_fuel": 1_000_000, "max_grammar_size": 500_000, "step_lexer_fuel": 200_000,
                 "step_max_items": 50_000, "max_lexer_states": 250_000}


class CompiledGrammar:
    """A grammar compiled once; ``state()`` gives each row its own matcher (a cheap copy)."""

    def __init__(self, matcher: Any, vocab_size: int):
        self._matcher = matcher
        self.vocab_size = vocab_size

    def state(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy(), self.vocab_size)


class GrammarState:
    """One row's matcher: the tokens allowed next, the token taken, a fork for a new beam."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self._words = np.empty(-(-vocab_size // 32), dtype="<u4")  # the bitmask, 32 tokens a word

    def bias(self) -> np.ndarray | None:
        """[V] float32: 0 for the tokens the grammar allows next, -inf for the others, to add to the
        row's logits; None when it allows nothing (the matcher failed). numpy, one table lookup per
        mask byte: adding a bias measured ~7x faster than a masked select (np.where, masked_fill) on
        this busy 2-core machine, and torch's small ops between two forwards cost far more."""
        words = self._words
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if not words.any():
            return None
        # Bit b of little-endian word w is token 32 * w + b: byte k holds tokens 8k..8k+7, low bit first.
        return BYTE_BIAS[words.view(np.uint8)].reshape(-1)[: self.vocab_size]  # [W*4, 8] -> [V]

    def advance(self, token: int) -> None:
        """Take ``token`` (a disallowed one puts the matcher in its error state: it then allows nothing)."""
        self.matcher.consume_token(token)

    def fork(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.vocab_size)


class ModelGrammars:
    """A model's compilers (one per EOS set, usually one): response_format -> its CompiledGrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.compilers: dict[tuple[int, ...], GrammarCompiler] = {}
        self._lock = threading.Lock()

    def compile(self, response_format: Any, name: str, eos_ids: list[int]) -> CompiledGrammar | None:
        from .forms import grammar_text, response_format_from

        form = response_format_from(response_format, name)
        if form is None:
            return None
        if self.tokenizer.vocab_size > self.vocab_size:
            raise InvalidOptionError(f"{name}: the tokenizer has {self.tokenizer.vocab_size} tokens but the model "
                                     f"only {self.vocab_size}; constrained decoding needs them to agree")
        eos = tuple(eos_ids)
        with self._lock:
            compiler = self.compilers.get(eos)
            if compiler is None:
                compiler = self.compilers[eos] = GrammarCompiler(self.tokenizer.backend.to_str(), self.vocab_size,
                                                                 list(eos))
        return compiler.compile(grammar_text(form, name), name)

    @property
    def compiles(self) -> int:
        return sum(compiler.compiles for compiler in self.compilers.values())


class GrammarCompiler:
    """Compiles grammar texts (``constraints.forms.grammar_text``) for one tokenizer; thread-safe,
    so servers compile on request threads and the engine thread finds the result cached."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int]):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._lltokenizer: Any = None
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars actually compiled (cache misses), for tests and metrics

    def lltokenizer(self) -> Any:
        from llguidance import LLTokenizer

        with self._lock:
            if self._lltokenizer is None:
                if not self.eos_ids:
                    raise InvalidOptionError("constrained decoding needs an end-of-sequence token; this model has none")
                try:
                    self._lltokenizer = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                    eos_token=self.eos_ids)
                except Exception as exc:  # llguidance's own error type for a tokenizer it cannot read
                    raise InvalidOptionError(f"constrained decoding cannot use this model's tokenizer: {exc}") from None
            return self._lltokenizer

    def compile(self, grammar: str, name: str = "response_format") -> CompiledGrammar:
        """The compiled grammar for ``grammar`` (cached by text); InvalidOptionError naming ``name``
        with llguidance's message when it is invalid, unsupported or past the limits."""
        with self._lock:
            found = self._cache.get(grammar)
            if found is not None:
                self._cache.move_to_end(grammar)
                return found
        from llguidance import LLMatcher, LLParserLimits

        matcher = LLMatcher(self.lltokenizer(), grammar, log_level=0, limits=LLParserLimits(**PARSER_LIMITS))
        if matcher.is_error():
            raise InvalidOptionError(f"{name} cannot be used: {matcher.get_error().strip()}")
        compiled = CompiledGrammar(matcher, self.vocab_size)
        with self._lock:
            self.compiles += 1
            self._cache[grammar] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled
