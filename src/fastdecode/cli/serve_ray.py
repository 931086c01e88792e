"""`fastdecode serve --ray`: the flags that put the server on Ray Serve (replicas, autoscaling,
routing), checked before anything loads; the service itself is integrations/ray_serve."""

from __future__ import annotations

from typing import Any

import click

from ..errors import InvalidOptionError
from ..integrations.ray_serve.options import ROUTING_POLICIES, ReplicaOptions
from ..load_settings import LoadSettings
from .errors import say

RAY_FLAGS = ("replicas", "min_replicas", "max_replicas", "target_ongoing_requests", "cpus_per_replica", "routing")


def ray_serve_options(command):
    options = [
        click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None,
                     metavar="[ADDRESS|auto|local]",
                     help="Serve on Ray Serve: local (the default value) starts a private Ray, auto joins this "
                          "machine's cluster, or a cluster ADDRESS. Needs fastdecode[ray]."),
        click.option("--replicas", type=int, default=None, help="With --ray: model replicas (default 1)."),
        click.option("--min-replicas", type=int, default=None,
                     help="With --ray: autoscale from this many replicas (with --max-replicas)."),
        click.option("--max-replicas", type=int, default=None, help="With --ray: autoscale up to this many replicas."),
        click.option("--target-ongoing-requests", type=float, default=None,
                     help="With --ray autoscaling: requests queued or running per replica the autoscaler "
                          "aims at (default 8)."),
        click.option("--cpus-per-replica", type=int, default=None,
                     help="With --ray: CPUs (and torch threads) per replica (default 1)."),
        click.option("--routing", type=click.Choice(ROUTING_POLICIES), default=None,
                     help="With --ray: prefix (a conversation returns to the replica that holds its prefix; "
                          "the default) or power-of-two (by load only)."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def ray_serve_values(kwargs: dict[str, Any]) -> tuple[str | None, ReplicaOptions | None]:
    """(the --ray address, the replica options), taken out of ``kwargs``; (None, None) without --ray."""
    address = kwargs.pop("ray_address")
    given = {name: kwargs.pop(name) for name in RAY_FLAGS}
    given = {name: value for name, value in given.items() if value is not None}
    if address is None:
        if given:
            flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
            raise InvalidOptionError(f"{flags} only apply with --ray")
        return None, None
    return address, ReplicaOptions(**given)


def run_on_ray(load: LoadSettings, address: str, options: ReplicaOptions, host: str, port: int,
               **settings: Any) -> int:
    """Serve ``load``'s model on Ray Serve until SIGTERM / Ctrl-C; ``settings``: ServeSettings fields."""
    from ..integrations.ray_serve.app import run_service
    from ..serve.service import ServeSettings

    return run_service(load, ServeSettings(**settings), options, address, host, port, say)
