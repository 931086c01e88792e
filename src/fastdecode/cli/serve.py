"""`fastdecode serve`: the command (click only; the server itself is imported when it runs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .errors import handle_errors
from .options import load_settings, model_options, speculative_flags, speculative_value
from .serve_ray import ray_serve_options, ray_serve_values, run_on_ray


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-batch-tokens", type=int, default=2048, show_default=True,
              help="Tokens per scheduler step (prefill chunks + decodes).")
@click.option("--max-queue", type=int, default=256, show_default=True,
              help="Sequences waiting or running (and beam-search prompts waiting for or running on "
                   "their thread); beyond it requests get 503 + Retry-After.")
@click.option("--api-key", default=None, envvar="FASTDECODE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/ routes (or env FASTDECODE_API_KEY).")
@click.option("--n-ctx", type=int, default=None, help="Context per request (default: the model's).")
@click.option("--n-keep", type=int, default=4, show_default=True,
              help="Attention-sink tokens kept when a conversation outgrows --n-ctx.")
@click.option("--context-overflow", type=click.Choice(["shift", "reevaluate", "error"]), default=None,
              help="Past the context: go on through a streaming cache, or answer 400 "
                   "(default: shift with --n-ctx, else error).")
@click.option("--max-body-bytes", type=int, default=1 << 20, show_default=True)
@click.option("--grace-seconds", type=float, default=30.0, show_default=True,
              help="On SIGTERM, how long in-flight requests may still run.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds a request's headers may take to arrive (from its first byte, or from the "
                   "connection); then 408 and the connection is closed.")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              help="Seconds a request's body may take to arrive after its headers; then 408 and close.")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Open connections; a new one beyond it gets 503 + Retry-After and is closed.")
@click.option("--embeddings", is_flag=True, default=False, help="Serve POST /v1/embeddings.")
@click.option("--pooling", type=click.Choice(["mean", "last"]), default="mean", show_default=True,
              help="Embeddings: the mean of the final hidden states, or the last token's.")
@click.option("--lenient", is_flag=True, default=False,
              help="Log and ignore request fields fastdecode does not know (default: a 400 naming the field).")
@click.option("--model-name", "--served-model-name", "model_names", multiple=True,
              help="A name the model answers to (repeat for aliases; the first is the one responses carry; "
                   "default: the file or folder name).")
@click.option("--strict-model-name", is_flag=True, default=False,
              help="Answer 404 to a request for another model name (default: one model answers any name).")
@click.option("--allowed-origins", "allowed_origins", multiple=True,
              help="Browser origins allowed to call the API across origins (CORS; repeat, or comma-separated; "
                   "'*' for any). Default: none.")
@ray_serve_options
@model_options
@speculative_flags[0]
@speculative_flags[1]
@speculative_flags[2]
@handle_errors
def serve(model: str | None, device: str, dtype: str, host: str, port: int, model_names: tuple[str, ...],
          allowed_origins: tuple[str, ...], context_overflow: str | None, **kwargs: Any) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with a web chat page at /.

    With --ray, the same API on Ray Serve: an ingress in front of model replicas (one engine each).
    """
    from ..api import default_model_path
    from ..serve.server import run

    ray_address, replica_options = ray_serve_values(kwargs)
    kwargs["speculative"] = speculative_value(kwargs)
    overflow = context_overflow or ("shift" if kwargs["n_ctx"] is not None else "error")
    pooling = kwargs.pop("pooling")
    kwargs["embeddings"] = pooling if kwargs.pop("embeddings") else None
    names = list(model_names) or [Path(model or default_model_path()).name.removesuffix(".gguf")]
    origins = tuple(o.strip() for value in allowed_origins for o in value.split(",") if o.strip())
    load = load_settings(model, device, dtype, kwargs)  # takes the model flags out of kwargs
    settings = dict(model_name=names[0], model_aliases=tuple(names[1:]), allowed_origins=origins,
                    context_overflow=overflow, **kwargs)
    if ray_address is not None:
        sys.exit(run_on_ray(load, ray_address, replica_options, host, port, **settings))
    generator = load.load()
    preload_draft_model(generator, kwargs["speculative"])
    sys.exit(run(generator, host, port, **settings))


def preload_draft_model(generator, speculative) -> None:
    """Load and check --draft-model before serving: a bad one stops the server at start (exit 2),
    and the first request does not wait for the load."""
    from ..config.speculative import speculative_settings

    settings = speculative_settings(speculative)
    if settings is not None and settings.draft_model is not None:
        generator.requests.draft_model(settings.draft_model, generator.model.kernels)
