"""`fastdecode inspect`: a model's architecture, sizes, attention kind, KV-cache cost, and each weight
group's type and bytes read per token."""

from __future__ import annotations

import json

import click

from ..models.registry import supported_architectures, supported_gguf_architectures
from ..load_settings import LoadSettings
from .errors import handle_errors, require_stream


@click.command(epilog=f"Supported architectures: {supported_architectures()}.\n\n"
                      f"GGUF architectures: {supported_gguf_architectures()}.")
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--quantize", default=None, type=click.Choice(["int8", "int4", "dequantize"]),
              help="Inspect the model as `--quantize` would load it.")
@click.option("--supported", is_flag=True, help="List the supported architectures (HF and GGUF) and exit.")
@handle_errors
def inspect(model: str | None, as_json: bool, quantize: str | None, supported: bool) -> None:
    """Show a model's architecture, sizes, attention kind, KV-cache cost and each weight group's
    type and bytes read per token."""
    require_stream("stdout")
    if supported:
        listing = {"architectures": supported_architectures().split(", "),
                   "gguf_architectures": supported_gguf_architectures().split(", ")}
        if as_json:
            click.echo(json.dumps(listing, indent=2))
        else:
            click.echo(f"architectures       {', '.join(listing['architectures'])}")
            click.echo(f"gguf architectures  {', '.join(listing['gguf_architectures'])}")
        return

    info = LoadSettings(model, quantize=quantize).load().inspect()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    width = max(len(k) for k in info)
    for key, value in info.items():
        if key == "weight_groups":
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
            value = f"{value:,}"
        click.echo(f"{key.replace('_', ' '):<{width}}  {value}")
    click.echo("")
    click.echo(f"{'weight group':<34} {'type':<8} {'tensors':>7} {'bytes':>13} {'bytes read/token':>17}")
    for row in info["weight_groups"]:
        click.echo(f"{row['group']:<34} {row['type']:<8} {row['tensors']:>7} {row['bytes']:>13,} "
                   f"{row['bytes_read_per_token']:>17,}")
