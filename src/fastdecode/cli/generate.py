"""`fastdecode generate`: one prompt, streamed to stdout as it is produced (beam search and several
samples print their final results at the end)."""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from ..errors import InvalidOptionError
from .errors import handle_errors, require_stream
from .options import (collect_options, generation_options, load_settings, model_options, streaming_options,
                      streaming_values)


@click.command()
@click.option("--prompt", "-p", required=True, help="The prompt (or, with --chat, the user message).")
@click.option("--chat/--no-chat", default=None,
              help="Apply the model's chat template (default: on when the model has one).")
@click.option("--stats", is_flag=True, help="Print timing and tokens/s on stderr at the end.")
@click.option("--endless", is_flag=True,
              help="Generate until interrupted (Ctrl-C), through a streaming cache (--n-ctx, default 1024).")
@model_options
@generation_options
@streaming_options
@handle_errors
def generate(prompt: str, chat: bool | None, stats: bool, endless: bool, model: str | None, device: str,
             dtype: str, **kwargs: Any) -> None:
    """Generate text for a prompt, streaming it to stdout as it is produced."""
    require_stream("stdout")
    started = time.perf_counter()
    from ..config import GenerationConfig

    streaming = streaming_values(kwargs)
    options = {**collect_options(kwargs), **streaming}
    if endless:
        source = click.get_current_context().get_parameter_source("max_new_tokens")
        if source is not None and source.name != "DEFAULT":  # it would be overridden: never silently
            raise InvalidOptionError("--endless generates until interrupted: --max-new-tokens does not apply "
                                     "(leave one of them out)")
        options["max_new_tokens"] = None
        options["n_ctx"] = options["n_ctx"] or 1024
        options.setdefault("eos_token_id", [])  # an endless stream does not stop at end-of-text
    GenerationConfig.from_options(**options)  # reject bad options before loading anything
    generator = load_settings(model, device, dtype, kwargs).load()
    loaded = time.perf_counter()
    use_chat = chat if chat is not None else bool(
        generator.tokenizer and generator.tokenizer.chat_template and not generator.config.is_encoder_decoder
    )
    prompt_ids = generator.encode_prompt(prompt, chat=use_chat)
    if options["num_beams"] > 1 or options["num_return_sequences"] > 1:
        _print_results(generator, prompt_ids, options, stats, started, loaded)
        return

    first_token_at = None
    count = 0
    try:
        for token, piece in generator.stream_with_tokens(prompt_ids, **options):
            if token is not None:
                count += 1
                first_token_at = first_token_at or time.perf_counter()
            if piece:
                click.echo(piece, nl=False)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if not endless:
            raise
    click.echo("")
    finished = time.perf_counter()
    if stats:
        first = first_token_at or finished
        decode_time = finished - first
        click.echo(
            f"[{len(prompt_ids)} prompt tokens | load {loaded - started:.2f}s | first token "
            f"{first - started:.2f}s after start | {count} new tokens in {decode_time:.2f}s"
            f"{f' = {max(count - 1, 0) / decode_time:.1f} tokens/s' if decode_time > 0 else ''}]",
            err=True,
        )


def _print_results(generator, prompt_ids: list[int], options: dict[str, Any], stats: bool, started: float,
                   loaded: float) -> None:
    """Beam search (or several samples): results are final only at the end, one block per sequence."""
    results = generator.generate_ids_with_details([prompt_ids], **options)
    finished = time.perf_counter()
    for rank, result in enumerate(results, start=1):
        if len(results) > 1:
            score = f" score {result.score:.4f}" if result.score is not None else ""
            click.echo(f"--- {rank}{score}")
        click.echo(generator.tokenizer.decode(result.tokens, skip_special_tokens=True))
    if stats:
        count = sum(len(r.tokens) for r in results)
        click.echo(f"[{len(prompt_ids)} prompt tokens | load {loaded - started:.2f}s | {len(results)} sequences, "
                   f"{count} new tokens in {finished - loaded:.2f}s]", err=True)
