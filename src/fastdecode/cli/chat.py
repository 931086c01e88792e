"""`fastdecode chat`: an interactive multi-turn chat on a streaming cache kept between turns."""

from __future__ import annotations

import sys
from typing import Any

import click

from ..errors import FastDecodeError
from .errors import handle_errors, require_stream, say
from .options import (load_settings, max_memory_option, model_options, require_sampling, streaming_options,
                      streaming_values)


@click.command()
@click.option("--system", default=None, help="System message.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="Longest reply.")
@click.option("--do-sample/--greedy", default=False)
@click.option("--temperature", type=float, default=1.0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--seed", type=int, default=None)
@max_memory_option
@model_options
@streaming_options
@handle_errors
def chat(system: str | None, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
    """Interactive multi-turn chat. The conversation stays in a streaming cache between turns,
    so earlier turns are never prefilled again. Ctrl-C stops a reply; Ctrl-D (or /quit) exits.
    A message that cannot be used (e.g. invalid UTF-8) is reported and the chat goes on."""
    require_stream("stdin")
    require_stream("stdout")
    require_sampling(kwargs)
    streaming = streaming_values(kwargs)
    streaming["n_ctx"] = streaming["n_ctx"] or 2048
    generator = load_settings(model, device, dtype, kwargs).load()
    session = generator.chat_session(system=system, **streaming, **kwargs)
    while True:
        try:
            message = click.prompt(click.style(">", bold=True), prompt_suffix=" ", default="", show_default=False)
        except (EOFError, click.exceptions.Abort):
            click.echo("")
            return
        if message.strip() in ("/quit", "/exit"):
            return
        if not message.strip():
            continue
        try:
            for piece in session.send(message):
                click.echo(piece, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        except FastDecodeError as exc:  # this message is bad; the conversation is not
            say(f"error: {exc}")
            continue
        click.echo("")
