"""The ``speculative`` generation option: which drafter proposes tokens and how many per step.

Accepted forms (validated once, here): ``None`` / ``False`` (off), ``"ngram"`` / ``True`` (prompt
lookup with the defaults below), or a dict ``{"method": "ngram", "num_tokens": k, "ngram_min": a,
"ngram_max": b, "prediction": [token ids]}`` (a prediction of the output, searched before the
prompt: OpenAI's predicted outputs), or ``{"draft_model": path, "num_tokens": k}`` (a smaller model
with the same tokenizer drafts k tokens greedily; engine/draft_model.py). Verification is exact (engine/speculative.py): speculation changes how fast
tokens come, never which tokens come.
"""

from __future__ import annotations

from dataclasses import dataclass
from os import PathLike
from typing import Any

from ..errors import InvalidOptionError
from ..validation import is_int

DEFAULT_NUM_TOKENS = 8  # most tokens drafted per step (the adaptive length starts here)
DEFAULT_DRAFT_MODEL_TOKENS = 4  # a draft model's tokens cost a draft step each
DEFAULT_NGRAM_MIN = 2
DEFAULT_NGRAM_MAX = 4
MAX_NUM_TOKENS = 32
MAX_NGRAM = 16
METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeSettings:
    method: str = "ngram"
    num_tokens: int = DEFAULT_NUM_TOKENS
    ngram_min: int = DEFAULT_NGRAM_MIN
    ngram_max: int = DEFAULT_NGRAM_MAX
    prediction: tuple[int, ...] = ()  # token ids the output is expected to resemble (OpenAI's predicted outputs)
    draft_model: str | None = None  # a smaller model's path (method "draft_model"): it drafts greedily


def speculative_settings(value: Any) -> SpeculativeSettings | None:
    """A ``speculative`` option value -> its settings (None: off); InvalidOptionError naming the problem."""
    if value is None or value is False:
        return None
    if value is True or value == "ngram":
        return SpeculativeSettings()
    if isinstance(value, str):
        raise InvalidOptionError(f"speculative must be 'ngram', a dict or false, got {value!r} "
                                 f"(drafters: {', '.join(METHODS)})")
    if not isinstance(value, dict):
        raise InvalidOptionError(f"speculative must be 'ngram', a dict or false, got {value!r}")
    known = {"method", "num_tokens", "ngram_min", "ngram_max", "prediction", "draft_model"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidOptionError(f"speculative: unknown key(s) {', '.join(map(repr, unknown))}; known: "
                                 f"{', '.join(sorted(known))}")
    draft_model = value.get("draft_model")
    if draft_model is not None and (not isinstance(draft_model, (str, PathLike)) or not str(draft_model)):
        raise InvalidOptionError(f"speculative draft_model must be a model path, got {draft_model!r}")
    method = value.get("method", "draft_model" if draft_model is not None else "ngram")
    if (method == "draft_model") != (draft_model is not None):
        raise InvalidOptionError("speculative: method 'draft_model' goes with a draft_model path (and only it)")
    if method not in METHODS:
        raise InvalidOptionError(f"speculative method must be one of {', '.join(METHODS)}, got {method!r}")
    prediction = value.get("prediction", ())
    if not isinstance(prediction, (list, tuple)) or not all(is_int(t) and t >= 0 for t in prediction):
        raise InvalidOptionError("speculative prediction must be a list of token ids (integers >= 0)")
    default_tokens = DEFAULT_DRAFT_MODEL_TOKENS if draft_model is not None else DEFAULT_NUM_TOKENS
    settings = SpeculativeSettings(method, value.get("num_tokens", default_tokens),
                                   value.get("ngram_min", DEFAULT_NGRAM_MIN), value.get("ngram_max", DEFAULT_NGRAM_MAX),
                                   tuple(prediction), None if draft_model is None else str(draft_model))
    if not is_int(settings.num_tokens) or not 1 <= settings.num_tokens <= MAX_NUM_TOKENS:
        raise InvalidOptionError(f"speculative num_tokens must be an integer in [1, {MAX_NUM_TOKENS}], "
                                 f"got {settings.num_tokens!r}")
    for name in ("ngram_min", "ngram_max"):
        if not is_int(getattr(settings, name)) or not 1 <= getattr(settings, name) <= MAX_NGRAM:
            raise InvalidOptionError(f"speculative {name} must be an integer in [1, {MAX_NGRAM}], "
                                     f"got {getattr(settings, name)!r}")
    if settings.ngram_min > settings.ngram_max:
        raise InvalidOptionError(f"speculative ngram_min ({settings.ngram_min}) exceeds ngram_max ({settings.ngram_max})")
    return settings
