"""The `fastdecode` command line: one module per subcommand, the options they share in options.py,
and how every command fails (one line, an exit code, no traceback) in errors.py."""

from __future__ import annotations

import click

from ..models.registry import supported_architectures, supported_gguf_architectures
from .batch import batch
from .chat import chat
from .generate import generate
from .inspect import inspect
from .perplexity import perplexity
from .serve import serve
from .serve_speech import serve_speech
from .transcribe import transcribe


SUPPORTED = (f"Supported architectures: {supported_architectures()}.\n\n"
             f"GGUF architectures: {supported_gguf_architectures()}.")


@click.group(epilog=SUPPORTED)
@click.version_option(package_name="fastdecode")
def main() -> None:
    """fastdecode: fast autoregressive decoding for transformer language models."""


for command in (generate, inspect, chat, perplexity, batch, serve, serve_speech, transcribe):
    main.add_command(command)

__all__ = ["main"]
