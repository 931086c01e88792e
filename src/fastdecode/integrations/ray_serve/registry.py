"""The request routers of this process, by deployment, for the ingress to list live replicas.

Its own module because Serve ships a request router's module to the processes that route by
value (a copy per process, not the imported module): state kept there would not be the state
the ingress sees. This module is imported, so there is one registry per process.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: dict[tuple[str, str], weakref.ref] = {}  # (app, deployment) -> the router of this process's handle


def register(app: str, deployment: str, router: Any) -> None:
    _ROUTERS[(app, deployment)] = weakref.ref(router)


def live_replicas(app: str, deployment: str) -> list[str] | None:
    """The replica ids this process's router for ``deployment`` can route to; None before the
    handle sent a first request (its router is created then)."""
    ref = _ROUTERS.get((app, deployment))
    router = ref() if ref is not None else None
    if router is None:
        return None
    return sorted(replica_id.unique_id for replica_id in router.curr_replicas)
