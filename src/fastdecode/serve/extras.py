"""The request fields beyond the basic sampling ones, with OpenAI's (or vLLM's) meaning:

* ``presence_penalty`` / ``frequency_penalty`` (OpenAI's additive penalties), ``logit_bias``
  (token id -> bias in [-100, 100]), ``min_p``, ``ignore_eos``: engine options of the same name;
* ``seed: -1``: a random seed (as no seed);
* ``best_of``: that many sampled candidates per choice, the ``n`` with the highest cumulative
  logprob answered (not with ``stream``, as OpenAI);
* ``use_beam_search`` (vLLM): beam search with width ``best_of`` (default ``n``), at least 2;
* ``prediction`` (OpenAI's predicted outputs, ``{"type": "content", "content": text}``): the expected
  output, which speculative decoding drafts from (the output itself stays exactly what the model
  generates; accepted and rejected draft tokens are reported in ``usage.completion_tokens_details``);
* ``speculative`` (fastdecode): ``false`` opts out of the server's ``--speculative`` default,
  ``"ngram"`` or ``{"method": "ngram", "num_tokens": k}`` opts in (config/speculative.py);
* completions only: ``echo`` (the prompt leads each choice's text, and its tokens' logprobs its
  logprobs; ``max_tokens: 0`` scores a prompt without generating) and ``suffix`` (fill in the
  middle, with the model's FIM tokens).

``apply_extras(body, endpoint)`` rewrites a body before ``parse_request`` (the beam-search alias);
``parse_extras(body, request)`` fills the rest in after it.
"""

from __future__ import annotations

from typing import Any

from ..config.generation import SAMPLING_ONLY, SEED_LIMIT
from .protocol import MAX_CHOICES, APIError, GenerationRequest, _Fields


def apply_extras(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``use_beam_search`` -> ``num_beams`` (the width: ``best_of``, else ``n``)."""
    fields = _Fields(body)
    if not fields.get("use_beam_search", bool, default=False):
        return body
    width = fields.integer("best_of", None, low=1, high=MAX_CHOICES) or fields.integer("n", 1, low=1)
    if width < 2:
        raise APIError(400, "use_beam_search needs a beam width of at least 2: set best_of (or n) >= 2",
                       param="use_beam_search")
    if fields.integer("num_beams", None) not in (None, width):
        raise APIError(400, f"num_beams ({body['num_beams']}) contradicts use_beam_search's width "
                            f"best_of / n ({width})", param="num_beams")
    return {**body, "num_beams": width}


def parse_extras(body: dict[str, Any], request: GenerationRequest) -> None:
    fields = _Fields(body)
    options = request.options
    for name in ("presence_penalty", "frequency_penalty"):
        options[name] = fields.number(name, 0.0, low=-2.0, high=2.0)
    options["min_p"] = fields.number("min_p", 0.0, low=0.0, high=1.0)
    options["ignore_eos"] = fields.get("ignore_eos", bool, default=False)
    bias = _logit_bias(fields)
    if bias:
        options["logit_bias"] = bias
    if options.get("seed") == -1:
        options["seed"] = None
    elif options.get("seed") is not None and options["seed"] < 0:
        raise APIError(400, f"seed must be an integer >= 0 (or -1 for a random one), got {options['seed']}",
                       param="seed")
    _best_of(fields, request)
    if not options["do_sample"]:  # temperature 0 is OpenAI's greedy (or beam search): sampling-only fields
        for name in SAMPLING_ONLY:  # ask nothing of it, and GenerationConfig refuses them without do_sample
            options.pop(name, None)
    seeded = 1 if request.is_beam else request.candidates  # choice j samples with seed + j (service.py)
    if options.get("seed") is not None and options["seed"] + seeded > SEED_LIMIT:
        raise APIError(400, f"seed must be below 2**64 - {seeded - 1} with {seeded} choices (choice j samples with "
                            f"seed + j), got {options['seed']}" if seeded > 1 else
                            f"seed must be below 2**64, got {options['seed']}", param="seed")
    _speculative(body, options)
    request.prediction = _prediction(body, request)
    if request.endpoint == "completion":
        request.echo = fields.get("echo", bool, default=False)
        request.suffix = fields.get("suffix", str, default=None)
        if request.echo and request.suffix is not None:
            raise APIError(400, "echo and suffix cannot be used together", param="suffix")
    if options["max_new_tokens"] == 0 and not request.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it is only allowed with echo (to score a prompt)",
                       param="max_tokens")


def _logit_bias(fields: _Fields) -> dict[int, float]:
    """{"token id": bias} (JSON keys are strings) -> {int: float}, each bias in [-100, 100]."""
    raw = fields.get("logit_bias", dict, default={})
    bias = {}
    for key, value in raw.items():
        token = key.strip() if isinstance(key, str) else ""
        if not token.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids (integers >= 0 as strings), got {key!r}",
                           param="logit_bias")
        number = _Fields({"logit_bias": value}).number("logit_bias", 0.0, low=-100.0, high=100.0)
        bias[int(token)] = number
    return bias


def _best_of(fields: _Fields, request: GenerationRequest) -> None:
    best_of = fields.integer("best_of", None, low=1, high=MAX_CHOICES)
    if best_of is None or request.is_beam:  # with use_beam_search, best_of was the beam width
        return
    if best_of < request.n:
        raise APIError(400, f"best_of ({best_of}) must be >= n ({request.n})", param="best_of")
    if best_of > request.n and request.stream:
        raise APIError(400, "best_of > n cannot stream: the best candidates are known only at the end",
                       param="best_of")
    if request.options["do_sample"]:  # greedy candidates are all the same sequence: n of them suffice
        request.best_of = best_of


def best_choices(choices: list[Any], n: int, candidates: int) -> list[Any]:
    """Each prompt's ``candidates`` choices (in order) -> its ``n`` with the highest cumulative
    logprob, best first, re-indexed as the request's choices."""
    best = []
    for start in range(0, len(choices), candidates):
        group = choices[start : start + candidates]
        group.sort(key=lambda c: -sum(lp for _, lp, _ in c.logprobs if lp is not None))
        best += group[:n]
    for index, choice in enumerate(best):
        choice.index = index
    return best


# Fill-in-the-middle token spellings (prefix, suffix, middle), in prefix-suffix-middle order.
FIM_TOKENS = [("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
              ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")]  # DeepSeek-Coder


def fill_in_middle_ids(tokenizer: Any, prefix: str | list[int], suffix: str) -> list[int]:
    """The prompt ids for ``suffix``: <prefix token> prefix <suffix token> suffix <middle token>
    (after the tokens the tokenizer puts before any text, e.g. BOS); a 400 naming ``suffix`` when
    the vocabulary has no FIM tokens."""
    for spelling in FIM_TOKENS:
        ids = [tokenizer.token_to_id(t) for t in spelling]
        if all(i is not None for i in ids):
            break
    else:
        raise APIError(400, "suffix needs a model with fill-in-the-middle tokens (e.g. <|fim_prefix|>, "
                            "<|fim_suffix|>, <|fim_middle|>); this model's vocabulary has none", param="suffix")
    lead = tokenizer.encode("", add_special_tokens=True)
    prefix_ids = list(prefix) if isinstance(prefix, list) else tokenizer.encode(prefix, add_special_tokens=False)
    return lead + [ids[0]] + prefix_ids + [ids[1]] + tokenizer.encode(suffix, add_special_tokens=False) + [ids[2]]


def _speculative(body: dict[str, Any], options: dict[str, Any]) -> None:
    """``speculative``: validated here so that a bad value is a 400 naming the field."""
    if body.get("speculative") is None:
        return
    from ..config.speculative import speculative_settings
    from ..errors import InvalidOptionError

    try:
        speculative_settings(body["speculative"])
    except InvalidOptionError as exc:
        raise APIError(400, str(exc), param="speculative") from None
    options["speculative"] = body["speculative"] or False


def _prediction(body: dict[str, Any], request: GenerationRequest) -> str | None:
    prediction = body.get("prediction")
    if prediction is None:
        return None
    content = prediction.get("content") if isinstance(prediction, dict) and prediction.get("type") == "content" \
        else None
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(400, 'prediction must be {"type": "content", "content": a string or a list of text parts}',
                       param="prediction")
    if request.options.get("speculative") is False:
        raise APIError(400, "prediction drafts tokens by speculative decoding: not with speculative: false",
                       param="prediction")
    if request.is_beam:
        raise APIError(400, "prediction drafts tokens for one sequence: beam search cannot use it", param="prediction")
    return content


def predicted_speculation(speculative: Any, tokenizer: Any, prediction: str) -> dict[str, Any]:
    """The request's ``speculative`` option (or the server's default) with the predicted output's
    token ids as a document to draft from."""
    if tokenizer is None:
        raise APIError(400, "prediction needs the model's tokenizer, and this model has none", param="prediction")
    settings = dict(speculative) if isinstance(speculative, dict) else {}
    return {**settings, "method": "ngram", "prediction": tokenizer.encode(prediction, add_special_tokens=False)}
