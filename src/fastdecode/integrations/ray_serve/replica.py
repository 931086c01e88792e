"""A model replica: one fastdecode engine behind the very application ``fastdecode serve`` runs.

Serve creates each replica as a Ray actor with its own CPUs; the replica loads the model with as
many torch threads, builds ``create_app(generator, settings)`` and runs its startup (the engine
thread). ``handle`` runs one forwarded request through that app and streams the response back to
the ingress, so every route, every strategy (beam, streaming past the context, sampling, ...)
and every model kind answers exactly as the single-process server does.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from ...load_settings import LoadSettings
from ...serve.service import ServeSettings
from ..ray import assigned_cpus
from .forwarding import ForwardedRequest, HostedApp, ReplicaIdentity, ResponseHead

ModelSource = LoadSettings | Callable[[], Any]  # what to load, or a function returning a Generator


def load_model(source: ModelSource) -> Any:
    return source.load() if isinstance(source, LoadSettings) else source()


class ModelReplica:
    """The model deployment's class (``serve.deployment`` is applied in app.py)."""

    async def __init__(self, source: ModelSource, settings: ServeSettings, threads: int | None = None):
        import ray
        import torch
        from ray import serve

        from ...serve.app import create_app

        torch.set_num_threads(max(1, int(threads or assigned_cpus())))  # the replica's share, not the node's
        self.hosted = HostedApp(create_app(load_model(source), settings))
        await self.hosted.start()
        self.identity = ReplicaIdentity(serve.get_replica_context().replica_id.unique_id,
                                        ray.util.get_node_ip_address(), os.getpid())

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The response to ``request``: its head, then its body as the app sends it."""
        async for item in self.hosted.handle(request, self.identity):
            yield item

    async def __del__(self) -> None:
        """Serve's graceful shutdown, after in-flight requests drained: stop the engine."""
        if hasattr(self, "identity"):
            await self.hosted.stop()
