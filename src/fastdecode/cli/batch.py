"""`fastdecode batch INPUT -o OUTPUT`: the command and its flags; the run itself is cli/batch_run.py's
``run_batch``.

Exit codes: 0 every input succeeded; 1 some inputs failed; 2 bad usage (and --fail-fast's first
failure); 3 the output could not be written (see cli/batch_run.py).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from .batch_run import run_batch
from ..pipeline.settings import BatchSettings
from .errors import handle_errors
from .options import collect_options, generation_options, load_settings, model_options


@click.command("batch")
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, allow_dash=True),
              help="Output .jsonl (a regular file; - for stdout); if it exists, inputs already in it are "
                   "skipped (resume).")
@click.option("--batch-size", type=int, default=None,
              help="Inputs generating at once in the engine (default 16); each finished one is replaced "
                   "at once. Excludes --max-batch-tokens.")
@click.option("--max-batch-tokens", type=int, default=None,
              help="Instead of --batch-size: cache tokens of the inputs generating at once, "
                   "sum of rows x (prompt + max new tokens).")
@click.option("--lookahead", type=int, default=None,
              help="An input starts only within this many inputs of the oldest one not yet written "
                   "(the reorder bound; default 8 x batch size, or 256).")
@click.option("--field", default="prompt", show_default=True, help="JSONL field that holds the prompt.")
@click.option("--input-format", type=click.Choice(["auto", "jsonl", "txt"]), default="auto", show_default=True,
              help="auto: by suffix (.jsonl / .txt), else by the first line.")
@click.option("--chat/--no-chat", default=None,
              help="Apply the model's chat template (default: on when the model has one).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first failed input (exit 2).")
@click.option("--overwrite", is_flag=True, help="Start again instead of resuming an existing output.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None,
              metavar="[ADDRESS|auto|local]",
              help="Generate on Ray actors: local (the default value) starts a private Ray for the run, "
                   "auto joins this machine's cluster, or a cluster ADDRESS. Needs fastdecode[ray].")
@click.option("--actors", type=int, default=1, show_default=True, help="With --ray: model replicas.")
@click.option("--cpus-per-actor", type=int, default=1, show_default=True,
              help="With --ray: CPUs (and torch threads) per replica.")
@model_options
@generation_options
@handle_errors
def batch(input_path: str, output: str, batch_size: int | None, max_batch_tokens: int | None,
          lookahead: int | None, field: str, input_format: str,
          chat: bool | None, quiet: bool, fail_fast: bool, overwrite: bool, ray_address: str | None, actors: int,
          cpus_per_actor: int, model: str | None, device: str, dtype: str, **kwargs: Any) -> None:
    """Generate for every line of INPUT (.jsonl or .txt, - for stdin) into OUTPUT (.jsonl).

    JSONL inputs are objects with a "prompt" (or --field) and an optional "id"; a .txt line
    is one prompt. Each output line is {"id", "line", "prompt", "output", "num_tokens",
    "finish_reason"} in input order (id defaults to the 0-based line index); a failed input
    gives {"id", "line", "error"}. Killed and restarted with the same command, the run
    resumes where it stopped. Exit code: 0 all ok, 1 some inputs failed, 2 bad usage.
    With --ray, --actors Ray actors (each --cpus-per-actor CPUs) generate; the output is the same.
    """
    options = collect_options(kwargs)  # --num-return-sequences > 1 makes each output a list
    settings = BatchSettings(batch_size=batch_size, max_batch_tokens=max_batch_tokens, lookahead=lookahead,
                             fail_fast=fail_fast)
    ray = None
    if ray_address is not None:
        from ..integrations.ray_batch import RayOptions

        ray = RayOptions(address=ray_address, actors=actors, cpus_per_actor=cpus_per_actor)
    code = run_batch(input_path, output, load_settings(model, device, dtype, kwargs), options, settings, field,
                     input_format, chat, quiet, overwrite, ray)
    sys.exit(code)
