"""``GenerationConfig``: the generation options, with Hugging Face ``generate()`` names.

Every option is validated here, once, so that strategies can trust their inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOptionError
from ..validation import is_finite, is_int

SEED_LIMIT = 1 << 64  # torch.Generator.manual_seed takes 0 <= seed < 2**64
INT_OPTION_LIMIT = 1 << 62  # any integer option past this would overflow a tensor index first
# Options only sampling reads, with the values that ask nothing of it: set otherwise without
# do_sample=True, greedy decoding and beam search would ignore them (refused in ``from_options``).
SAMPLING_ONLY = {"temperature": (1.0, 0.0), "top_p": (1.0,), "top_k": (0,), "min_p": (0.0,)}
INT_OPTIONS = ("max_new_tokens", "min_new_tokens", "top_k", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
               "num_beams", "num_return_sequences", "n_ctx", "n_keep", "n_discard", "best_of")


@dataclass
class GenerationConfig:
    """Generation options with Hugging Face names. ``validate()`` raises InvalidOptionError."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties on the tokens generated so far: logit -= frequency * count + presence * (count > 0)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's range -100..100)
    min_p: float = 0.0  # sampling: drop tokens less likely than min_p times the most likely one
    ignore_eos: bool = False  # EOS neither stops generation nor counts as special: max_new_tokens sets the length
    # Sampling: best_of candidates per prompt, the num_return_sequences with the highest cumulative logprob returned
    best_of: int | None = None
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0  # encoder-decoder only: never copy an n-gram of the source
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    eos_token_id: int | list[int] | None = None
    stop: str | list[str] | None = None
    seed: int | list[int] | None = None  # an int, or one per prompt (see decoding/sampling.py)
    use_cache: bool = True
    # Memory a request may use, in bytes (or "8GB", "512MiB"...): checked before allocating.
    # None: the memory available now (MemAvailable, or free CUDA memory).
    max_memory: int | str | None = None
    # Streaming ("infinite") generation: a cache of n_ctx slots, n_keep attention sinks.
    n_ctx: int | None = None
    n_keep: int = 4
    n_discard: int | None = None  # default: 1 for shift (a true ring), half the window for reevaluate
    policy: str = "shift"  # "shift" (no recomputation) or "reevaluate"
    # The output's constraint (constraints/forms.py): a dict form ({"type": "json_schema", ...},
    # "json_object", "regex", "choice", "grammar") or a Pydantic model class; None: free text.
    response_format: Any = None
    # Speculative decoding (config/speculative.py): None / False off, "ngram" (prompt lookup) or a dict.
    speculative: Any = None

    @classmethod
    def from_options(cls, base: "GenerationConfig | None" = None, **options: Any) -> "GenerationConfig":
        """Overlay keyword options on ``base`` (or the defaults); unknown names are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidOptionError(
                f"unknown generation option(s): {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
            )
        values = dataclasses.asdict(base) if base is not None else {}
        # None means "the default" except where None is itself a meaningful value.
        nullable = {f.name for f in dataclasses.fields(cls) if f.default is None} | {"max_new_tokens"}
        values.update({k: v for k, v in options.items() if v is not None or k in nullable})
        if values.get("seed") == -1:  # OpenAI / vLLM clients send -1 for "random"
            values["seed"] = None
        if "speculative" not in options and (values.get("num_beams", 1) > 1 or values.get("n_ctx") is not None
                                             or values.get("use_cache") is False):
            values["speculative"] = None  # a default speculation applies where it can run (greedy, sampling)
        config = cls(**values)
        config.validate()
        if not config.do_sample:
            _refuse_sampling_only(options)
        return config

    def validate(self) -> None:
        def bad(message: str) -> InvalidOptionError:
            return InvalidOptionError(message)

        for name in INT_OPTIONS:
            value = getattr(self, name)
            if is_int(value) and value > INT_OPTION_LIMIT:  # would overflow a tensor index long before
                raise bad(f"{name}={value} is absurdly large (the limit is 2**62)")
        if self.max_new_tokens is None:
            if self.n_ctx is None:
                raise bad("max_new_tokens=None (endless generation) needs a streaming cache: set n_ctx")
        elif not is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise bad(f"max_new_tokens must be an integer >= 0 (or None with n_ctx), got {self.max_new_tokens!r}")
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise bad(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise bad(f"min_new_tokens ({self.min_new_tokens}) exceeds max_new_tokens ({self.max_new_tokens})")
        if not isinstance(self.do_sample, bool):
            raise bad(f"do_sample must be True or False, got {self.do_sample!r}")
        if not isinstance(self.use_cache, bool):
            raise bad(f"use_cache must be True or False, got {self.use_cache!r}")
        if not is_finite(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 0):
            raise bad(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not is_finite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        self._validate_openai_processors(bad)
        if not is_int(self.no_repeat_ngram_size) or self.no_repeat_ngram_size < 0:
            raise bad(f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}")
        if not is_int(self.encoder_no_repeat_ngram_size) or self.encoder_no_repeat_ngram_size < 0:
            raise bad("encoder_no_repeat_ngram_size must be an integer >= 0, "
                      f"got {self.encoder_no_repeat_ngram_size!r}")
        if not is_int(self.num_beams) or self.num_beams < 1:
            raise bad(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        if not is_int(self.num_return_sequences) or self.num_return_sequences < 1:
            raise bad(f"num_return_sequences must be an integer >= 1, got {self.num_return_sequences!r}")
        if self.num_beams > 1:
            self._validate_beams(bad)
        elif self.num_return_sequences > 1 and not self.do_sample:
            raise bad(
                "num_return_sequences > 1 needs do_sample=True or num_beams > 1 "
                "(greedy decoding would return identical copies)"
            )
        if self.early_stopping not in (True, False, "never"):
            raise bad(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.eos_token_id is not None and not isinstance(self.eos_token_id, (int, list, tuple)):
            raise bad(f"eos_token_id must be a non-negative integer or a list of them, got {self.eos_token_id!r}")
        eos = self.eos_token_ids_or_none()
        if eos is not None and any(not is_int(t) or not 0 <= t <= INT_OPTION_LIMIT for t in eos):
            raise bad(f"eos_token_id must be a non-negative integer or a list of them, got {self.eos_token_id!r}")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        stops = self.stop_strings()
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        seeds = self.seed if isinstance(self.seed, list) else [] if self.seed is None else [self.seed]
        if any(not is_int(s) or not 0 <= s < SEED_LIMIT for s in seeds) or (isinstance(self.seed, list) and not seeds):
            raise bad(f"seed must be an integer in [0, 2**64) (or a list of them, one per prompt), got {self.seed!r}")
        if self.max_memory is not None:
            from ..memory import parse_size

            parse_size(self.max_memory)
        self._validate_streaming(bad)
        self._validate_speculative(bad)
        if self.response_format is not None:
            from ..constraints.forms import response_format_from

            response_format_from(self.response_format)

    def _validate_openai_processors(self, bad) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_finite(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be a number in [-2, 2], got {value!r}")
        if not is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.ignore_eos, bool):
            raise bad(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.best_of is not None:
            if not is_int(self.best_of) or self.best_of < 1:
                raise bad(f"best_of must be an integer >= 1, got {self.best_of!r}")
            if self.best_of < self.num_return_sequences:
                raise bad(f"best_of ({self.best_of}) must be >= num_return_sequences ({self.num_return_sequences})")
            if self.num_beams > 1 or self.n_ctx is not None or not self.use_cache:
                raise bad("best_of ranks sampled candidates in the engine: not with beam search, n_ctx or "
                          "use_cache=False")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                if not is_int(token) or not 0 <= token <= INT_OPTION_LIMIT:
                    raise bad(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not is_finite(bias) or not -100.0 <= bias <= 100.0:
                    raise bad(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")

    def _validate_beams(self, bad) -> None:
        if self.num_return_sequences > self.num_beams:
            raise bad(f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams})")
        if self.do_sample:
            raise bad("beam sampling (num_beams > 1 with do_sample=True) is not supported; use do_sample=False")
        if not is_finite(self.length_penalty):
            raise bad(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.n_ctx is not None:
            raise bad("beam search keeps every beam's whole history: it cannot use a streaming cache (n_ctx)")
        if self.stop_strings():
            raise InvalidOptionError("stop strings are not supported with beam search (num_beams > 1)", option="stop")
        if self.max_new_tokens is None:
            raise bad("beam search needs max_new_tokens")
        if not self.use_cache:
            raise bad("beam search always runs on its de-duplicated cache: use_cache=False is for greedy and "
                      "sampling (the naive reference)")

    def _validate_streaming(self, bad) -> None:
        if self.policy not in ("shift", "reevaluate"):
            raise bad(f"policy must be 'shift' or 'reevaluate', got {self.policy!r}")
        if self.n_ctx is None:
            given = [f"{name}={value!r}" for name, value, default in (("n_keep", self.n_keep, 4),
                     ("n_discard", self.n_discard, None), ("policy", self.policy, "shift")) if value != default]
            if given:  # they shape a streaming cache, and there is none: never silently ignored
                raise bad(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to a streaming cache: "
                          "set n_ctx too")
            return
        if not is_int(self.n_ctx) or self.n_ctx < 2:
            raise bad(f"n_ctx must be an integer >= 2, got {self.n_ctx!r}")
        if not is_int(self.n_keep) or not 0 <= self.n_keep < self.n_ctx - 1:
            raise bad(f"n_keep must be an integer in [0, n_ctx - 1), got {self.n_keep!r} with n_ctx={self.n_ctx}")
        window = self.n_ctx - self.n_keep
        if self.n_discard is not None and (not is_int(self.n_discard) or not 1 <= self.n_discard < window):
            raise bad(f"n_discard must be an integer in [1, {window - 1}] (n_ctx - n_keep - 1), got {self.n_discard!r}")
        if self.num_return_sequences != 1:
            raise bad("streaming generation (n_ctx) produces one sequence per prompt: num_return_sequences must be 1")

    def _validate_speculative(self, bad) -> None:
        from .speculative import speculative_settings

        if speculative_settings(self.speculative) is None:
            return
        if self.num_beams > 1:
            raise bad("speculative decoding drafts for one sequence: beam search (num_beams > 1) refuses it")
        if not self.use_cache:
            raise bad("speculative decoding verifies drafts against the cache: not with use_cache=False")
        if self.n_ctx is not None:
            raise bad("speculative decoding does not run on a streaming cache (n_ctx) yet: drop one of them")

    @property
    def discard_count(self) -> int:
        """Tokens dropped when the streaming cache is full. Default: one for shift (a true ring:
        the fullest window, and shifting costs nothing), half of the window for re-evaluate (each
        drop costs a rebuild, amortized over the tokens that refill it)."""
        if self.n_discard is not None:
            return self.n_discard
        return 1 if self.policy == "shift" else max(1, (self.n_ctx - self.n_keep) // 2)

    @property
    def is_sampling(self) -> bool:
        """Sampling with temperature 0 is greedy, as users expect."""
        return bool(self.do_sample) and self.temperature > 0

    def eos_token_ids_or_none(self) -> list[int] | None:
        if self.eos_token_id is None:
            return None
        if isinstance(self.eos_token_id, (list, tuple)):
            return list(self.eos_token_id)
        return [self.eos_token_id]

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _refuse_sampling_only(options: dict[str, Any]) -> None:
    """The sampling options a call set (None: the default) to values that would shape sampling,
    on a config that does not sample: an InvalidOptionError naming them (temperature 0 is greedy)."""
    given = [f"{name}={options[name]!r}" for name, neutral in SAMPLING_ONLY.items()
             if options.get(name) is not None and options[name] not in neutral]
    if given:
        raise InvalidOptionError(f"{', '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling, which "
                                 "do_sample=False (the default: greedy decoding or beam search) does not do, so it "
                                 "would be ignored: pass do_sample=True to sample")
