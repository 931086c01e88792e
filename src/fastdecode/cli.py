"""The `fastdecode` command line.

Every ``FastDecodeError`` is printed as one line on stderr and exits with code 2 (the same code
click uses for usage errors; an error's own ``exit_code`` where it has one); no traceback for bad
input. A closed standard stream a command needs is such an error; a write error on stdout (a full
disk, /dev/full, a closed pipe) is one line and exit code 1.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import time
from typing import Any

import click

from .errors import FastDecodeError, InvalidOptionError

# Errors writing stdout that are the environment's, not a bug: one line, exit 1.
WRITE_ERRORS = (errno.EPIPE, errno.EBADF, errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.EFBIG)


def _say(message: str) -> None:
    """One line on stderr, if there is a stderr."""
    try:
        if sys.stderr is not None:
            sys.stderr.write(message + "\n")
            sys.stderr.flush()
    except OSError:
        pass


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null so that the interpreter's final flush cannot fail (and print) again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    except OSError:
        pass


def require_stream(name: str) -> None:
    """Raise a typed error when standard input / output (``name``: "stdin" or "stdout") is closed."""
    if getattr(sys, name) is None:
        what = {"stdin": "input", "stdout": "output"}[name]
        raise InvalidOptionError(f"standard {what} is closed: this command needs it")


def _handle_errors(command):
    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FastDecodeError as exc:
            _say(f"error: {exc}")
            sys.exit(getattr(exc, "exit_code", 2))
        except KeyboardInterrupt:
            _say("")
            sys.exit(130)
        except OSError as exc:
            if exc.errno not in WRITE_ERRORS:
                raise
            _silence_stdout()
            _say(f"error: cannot write the output: {exc.strerror or exc}")
            sys.exit(1)

    return wrapper


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
        max_memory_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


max_memory_option = click.option(
    "--max-memory", default=None,
    help="Memory a request may use (bytes, or e.g. 8GB, 512MiB); checked before allocating. "
         "Default: the memory available now.")


def streaming_options(command):
    """Streaming cache flags: n_ctx slots with n_keep attention sinks (see generation/streaming.py)."""
    options = [
        click.option("--n-ctx", type=int, default=None, help="Streaming cache size in tokens (enables streaming)."),
        click.option("--n-keep", type=int, default=4, show_default=True, help="Attention-sink tokens kept."),
        click.option("--n-discard", type=int, default=None, help="Tokens dropped when full (default: half)."),
        click.option("--policy", type=click.Choice(["shift", "reevaluate"]), default="shift", show_default=True),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _streaming_values(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {name: kwargs.pop(name) for name in ("n_ctx", "n_keep", "n_discard", "policy")}


def model_options(command):
    command = click.option("--dtype", default="float32", show_default=True,
                           type=click.Choice(["float32", "bfloat16", "float16"]))(command)
    command = click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")(command)
    return click.option("--model", "-m", default=None,
                        help="HF folder or .gguf file (default: the embedded SmolLM2-135M-Instruct).")(command)


def _collect_options(kwargs: dict[str, Any]) -> dict[str, Any]:
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
    return options


@click.group()
@click.version_option(package_name="fastdecode")
def main() -> None:
    """fastdecode: fast autoregressive decoding for transformer language models."""


@main.command()
@click.option("--prompt", "-p", required=True, help="The prompt (or, with --chat, the user message).")
@click.option("--chat/--no-chat", default=None,
              help="Apply the model's chat template (default: on when the model has one).")
@click.option("--stats", is_flag=True, help="Print timing and tokens/s on stderr at the end.")
@click.option("--endless", is_flag=True,
              help="Generate until interrupted (Ctrl-C), through a streaming cache (--n-ctx, default 1024).")
@model_options
@generation_options
@streaming_options
@_handle_errors
def generate(prompt: str, chat: bool | None, stats: bool, endless: bool, model: str | None, device: str,
             dtype: str, **kwargs: Any) -> None:
    """Generate text for a prompt, streaming it to stdout as it is produced."""
    require_stream("stdout")
    started = time.perf_counter()
    from . import load
    from .config import GenerationConfig

    streaming = _streaming_values(kwargs)
    options = {**_collect_options(kwargs), **streaming}
    if endless:
        options["max_new_tokens"] = None
        options["n_ctx"] = options["n_ctx"] or 1024
        options.setdefault("eos_token_id", [])  # an endless stream does not stop at end-of-text
    GenerationConfig.from_options(**options)  # reject bad options before loading anything
    generator = load(model, device=device, dtype=dtype)
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


@main.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_handle_errors
def inspect(model: str | None, as_json: bool) -> None:
    """Show a model's architecture, sizes, attention kind and KV-cache cost."""
    from . import load
    require_stream("stdout")

    info = load(model).inspect()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
            value = f"{value:,}"
        click.echo(f"{key.replace('_', ' '):<{width}}  {value}")


@main.command()
@click.option("--system", default=None, help="System message.")
@click.option("--max-new-tokens", type=int, default=512, show_default=True, help="Longest reply.")
@click.option("--do-sample/--greedy", default=False)
@click.option("--temperature", type=float, default=1.0)
@click.option("--top-p", type=float, default=1.0)
@click.option("--seed", type=int, default=None)
@max_memory_option
@model_options
@streaming_options
@_handle_errors
def chat(system: str | None, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
    """Interactive multi-turn chat. The conversation stays in a streaming cache between turns,
    so earlier turns are never prefilled again. Ctrl-C stops a reply; Ctrl-D (or /quit) exits.
    A message that cannot be used (e.g. invalid UTF-8) is reported and the chat goes on."""
    from . import load

    require_stream("stdin")
    require_stream("stdout")
    streaming = _streaming_values(kwargs)
    streaming["n_ctx"] = streaming["n_ctx"] or 2048
    generator = load(model, device=device, dtype=dtype)
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
            _say(f"error: {exc}")
            continue
        click.echo("")


@main.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
@max_memory_option
@model_options
@streaming_options
@_handle_errors
def perplexity(file: str, as_json: bool, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
    """Per-token loss and perplexity of a text file under the model (streaming with --n-ctx)."""
    import math
    from pathlib import Path

    from . import load

    require_stream("stdout")
    if file == "-":
        require_stream("stdin")
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidOptionError(f"cannot read {file}: {exc}") from exc
    streaming = _streaming_values(kwargs)
    generator = load(model, device=device, dtype=dtype)
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


from .pipeline.cli import batch_command  # noqa: E402 - the factory needs the decorators above

main.add_command(batch_command(model_options, generation_options, _handle_errors, _collect_options))

from .serve.cli import serve_command  # noqa: E402 - click only; the server is imported when it runs

main.add_command(serve_command(model_options, _handle_errors))


if __name__ == "__main__":  # pragma: no cover
    main()
