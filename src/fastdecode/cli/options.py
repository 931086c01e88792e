"""The options several subcommands share: generation options with the Hugging Face names (dashes for
underscores), the streaming cache, the model to load; and turning parsed flags back into the
options ``Generator`` methods take."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from ..errors import InvalidOptionError
from ..layers.products import PROMPT_ROWS
from ..load_settings import LoadSettings


def generation_options(command):
    """Flags that mirror the Hugging Face option names (dashes for underscores)."""
    options = [
        click.option("--max-new-tokens", type=int, default=256, show_default=True),
        click.option("--min-new-tokens", type=int, default=0, show_default=True),
        click.option("--do-sample/--greedy", default=False, help="Sample instead of greedy decoding."),
        click.option("--temperature", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=None),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--repetition-penalty", type=float, default=1.0, show_default=True),
        click.option("--eos-token-id", type=int, multiple=True, help="Token id that ends generation (repeatable)."),
        click.option("--stop", multiple=True, help="Stop string (repeatable); not included in the output."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        click.option("--num-beams", type=int, default=1, show_default=True, help="Beam search when > 1."),
        click.option("--length-penalty", type=float, default=1.0, show_default=True,
                     help="Beam score = log-prob sum / generated length ** this."),
        click.option("--early-stopping", type=click.Choice(["true", "false", "never"]), default="false",
                     show_default=True, help="Beam search stopping rule (as transformers)."),
        click.option("--num-return-sequences", type=int, default=1, show_default=True,
                     help="Results per prompt (<= --num-beams for beam search)."),
        click.option("--no-repeat-ngram-size", type=int, default=0, show_default=True,
                     help="Never repeat an n-gram of this size (0: off)."),
        click.option("--encoder-no-repeat-ngram-size", type=int, default=0, show_default=True,
                     help="Encoder-decoder: never copy an n-gram of this size from the source (0: off)."),
        click.option("--no-cache", "no_cache", is_flag=True, help="Recompute everything each step (slow reference)."),
        click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Constrain the output to this JSON schema file."),
        click.option("--grammar", "grammar", type=click.Path(exists=True, dir_okay=False), default=None,
                     help="Constrain the output to this grammar file (GBNF, or llguidance's Lark)."),
        max_memory_option,
        *speculative_flags,
    ]
    for option in reversed(options):
        command = option(command)
    return command


speculative_flags = [
    click.option("--speculative", type=click.Choice(["ngram", "off"]), default="off", show_default=True,
                 help="Speculative decoding: ngram drafts tokens by prompt lookup and verifies them in one step "
                      "(the same output, faster where text repeats: edits, summaries, code)."),
    click.option("--draft-model", default=None,
                 help="Speculative decoding with this smaller model (GGUF or HF folder, the same tokenizer) "
                      "drafting tokens for the model to verify."),
    click.option("--speculative-tokens", type=int, default=None,
                 help="Most tokens drafted per step (default 8 for ngram, 4 for a draft model; adapts to what "
                      "is accepted)."),
]


def speculative_value(kwargs: dict[str, Any]) -> Any:
    """--speculative / --draft-model / --speculative-tokens (taken out of ``kwargs``) -> the
    ``speculative`` option."""
    method, draft = kwargs.pop("speculative", "off"), kwargs.pop("draft_model", None)
    tokens = kwargs.pop("speculative_tokens", None)
    if draft is not None:
        if method != "off":
            raise InvalidOptionError("give --speculative ngram or --draft-model, not both")
        return {"draft_model": draft} if tokens is None else {"draft_model": draft, "num_tokens": tokens}
    if method == "off":
        if tokens is not None:
            raise InvalidOptionError("--speculative-tokens needs --speculative ngram or --draft-model")
        return None
    return method if tokens is None else {"method": method, "num_tokens": tokens}


max_memory_option = click.option(
    "--max-memory", default=None,
    help="Memory a request may use (bytes, or e.g. 8GB, 512MiB); checked before allocating. "
         "Default: the memory available now.")


def streaming_options(command):
    """Streaming cache flags: n_ctx slots with n_keep attention sinks (see engine/streaming_policy.py)."""
    options = [
        click.option("--n-ctx", type=int, default=None, help="Streaming cache size in tokens (enables streaming)."),
        click.option("--n-keep", type=int, default=4, show_default=True, help="Attention-sink tokens kept."),
        click.option("--n-discard", type=int, default=None, help="Tokens dropped when full (default: 1 for shift, half the window for reevaluate)."),
        click.option("--policy", type=click.Choice(["shift", "reevaluate"]), default="shift", show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def streaming_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The streaming flags, taken out of ``kwargs``."""
    return {name: kwargs.pop(name) for name in ("n_ctx", "n_keep", "n_discard", "policy")}


def model_options(command):
    """Which model to load and how: --model, --quantize, --prompt-rows, --device, --dtype (see
    ``load_settings``)."""
    command = click.option("--prompt-rows", default=PROMPT_ROWS[0], show_default=True, type=click.Choice(PROMPT_ROWS),
                           help="How prompt rows of quantized weights are multiplied: int8-mlp (the MLP's products "
                                "on the integer kernels, the attention's exact), exact (the weights' float32 values) "
                                "or int8 (every product on the integer kernels, llama.cpp's choice: faster prompts, "
                                "near ties may flip).")(command)
    command = click.option("--dtype", default="float32", show_default=True,
                           type=click.Choice(["float32", "bfloat16", "float16"]))(command)
    command = click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")(command)
    command = click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "dequantize"]),
                           help="int8/int4: quantize a float checkpoint at load; dequantize: decode GGUF blocks "
                                "to --dtype (default: GGUF blocks run as they are).")(command)
    return click.option("--model", "-m", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")(command)


def require_sampling(kwargs: dict[str, Any]) -> None:
    """Sampling flags given without --do-sample would be ignored by greedy decoding: refused, exit 2
    (temperature 0 is greedy itself)."""
    if kwargs.get("do_sample"):
        return
    given = [f"{name}={kwargs[name]!r}" for name, neutral in (("temperature", (1.0, 0.0)), ("top_p", (1.0,)),
                                                             ("top_k", (None,)), ("seed", (None,)))
             if name in kwargs and kwargs[name] not in neutral]
    if given:
        raise InvalidOptionError(f"{', '.join(given)} {'shapes' if len(given) == 1 else 'shape'} sampling, and "
                                 "greedy decoding (the default) would ignore it: add --do-sample")


def collect_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generation_options``' flags as the options ``Generator`` methods take (HF names)."""
    require_sampling(kwargs)
    options = {
        name: kwargs[name]
        for name in ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
                     "repetition_penalty", "seed", "num_beams", "length_penalty", "num_return_sequences",
                     "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "max_memory")
    }
    options["early_stopping"] = {"true": True, "false": False, "never": "never"}[kwargs["early_stopping"]]
    options["use_cache"] = not kwargs["no_cache"]
    if kwargs["eos_token_id"]:
        options["eos_token_id"] = list(kwargs["eos_token_id"])
    if kwargs["stop"]:
        options["stop"] = list(kwargs["stop"])
    options["speculative"] = speculative_value(kwargs)
    constraint = file_constraint(kwargs.get("json_schema"), kwargs.get("grammar"))
    if constraint is not None:
        options["response_format"] = constraint
    return options


def file_constraint(schema_path: str | None, grammar_path: str | None) -> dict | None:
    """--json-schema / --grammar -> a response_format dict (constraints/forms.py), or None."""
    if schema_path and grammar_path:
        raise InvalidOptionError("give --json-schema or --grammar, not both")
    if grammar_path:
        return {"type": "grammar", "grammar": Path(grammar_path).read_text(encoding="utf-8")}
    if not schema_path:
        return None
    try:
        schema = json.loads(Path(schema_path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"--json-schema {schema_path} is not valid JSON: {exc}") from None
    return {"type": "json_schema", "json_schema": {"name": Path(schema_path).stem, "schema": schema}}


def load_settings(model: str | None, device: str, dtype: str, kwargs: dict[str, Any]) -> LoadSettings:
    """The model flags (``model_options``) as one record; ``--quantize`` and ``--prompt-rows`` are taken
    out of ``kwargs``."""
    return LoadSettings(model=model, device=device, dtype=dtype, quantize=kwargs.pop("quantize", None),
                        prompt_rows=kwargs.pop("prompt_rows", "exact"))
