"""`fastdecode perplexity`: per-token loss and perplexity of a text file under the model."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import click

from ..errors import InvalidOptionError
from .errors import handle_errors, require_stream
from .options import load_settings, max_memory_option, model_options, streaming_options, streaming_values


@click.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@max_memory_option
@model_options
@streaming_options
@handle_errors
def perplexity(file: str, as_json: bool, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
    """Per-token loss and perplexity of a text file under the model (streaming with --n-ctx)."""
    require_stream("stdout")
    if file == "-":
        require_stream("stdin")
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"cannot read {file}: {exc}") from exc
    streaming = streaming_values(kwargs)
    generator = load_settings(model, device, dtype, kwargs).load()
    started = time.perf_counter()
    losses = generator.score(text, **streaming, max_memory=kwargs.get("max_memory"))
    elapsed = time.perf_counter() - started
    mean = sum(losses) / len(losses)
    result = {"tokens": len(losses), "mean_nll": mean, "perplexity": math.exp(mean), "seconds": elapsed,
              "tokens_per_second": len(losses) / elapsed, **streaming}
    if as_json:
        click.echo(json.dumps(result))
    else:
        click.echo(f"{len(losses)} tokens  mean NLL {mean:.4f}  perplexity {math.exp(mean):.3f}  "
                   f"({len(losses) / elapsed:.0f} tokens/s)")
