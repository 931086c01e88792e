"""Which replica takes a request: Ray Serve request routers for the model deployment.

Routers run inside the caller (the ingress), one per deployment handle. Two policies:

* ``prefix`` (default): Ray Serve's ``PrefixCacheAffinityRouter``. It keeps a tree of the prompt
  texts each replica was sent; while the replicas' queues differ by at most
  ``imbalanced_threshold`` requests it sends a request to the replicas whose texts share the
  longest prefix with its prompt (a conversation's next turn goes back to the replica whose
  prefix cache holds the turns before), to the replica holding the fewest texts when nothing
  matches 10% of the prompt, and, when the queues are imbalanced, to the less loaded of two
  random replicas. Ray 2.60 ships it as ``ray.serve.llm.request_router.PrefixCacheAffinityRouter``,
  but ``ray.serve.llm`` imports vLLM or SGLang at import time; the same class is imported from
  the module that defines it (pinned with the release in the ``ray`` extra).
* ``power-of-two``: Serve's default, the less loaded of two random replicas.

Both also honour a request pinned to one replica (``ForwardedRequest.replica``: the ingress
collects each replica's /metrics and /health that way) and register themselves so the ingress
can list the live replicas (registry.py).
"""

from __future__ import annotations

from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter

from .forwarding import ForwardedRequest
from .registry import register

def _forwarded(pending_request: Any) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None


class _PinnedRequests:
    """Requests pinned to one replica, and the registry of routers, for either policy (first in the
    bases: its ``initialize_state`` runs the policy's, then registers the router)."""

    def initialize_state(self, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        register(self._deployment_id.app_name, self._deployment_id.name, self)

    @staticmethod
    def _pinned(candidates: list[Any], pending_request: Any) -> list[list[Any]] | None:
        """The pinned replica as the only choice ([] while it is not routable: the caller's
        timeout ends the wait); None for an unpinned request."""
        request = _forwarded(pending_request)
        if request is None or request.replica is None:
            return None
        pending_request.routing_context.should_backoff = True  # no other choice to try: wait between tries
        return [[replica for replica in candidates if replica.replica_id.unique_id == request.replica]]


class PrefixAwareRouter(_PinnedRequests, PrefixCacheAffinityRouter):
    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        pinned = self._pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        request = _forwarded(pending_request)
        if request is None or request.prompt is None:  # nothing to match (GET routes): by load
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        return await super().choose_replicas(candidate_replicas, pending_request)

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        request = _forwarded(pending_request)
        if request is not None and request.prompt is not None and request.replica is None:
            super().on_request_routed(pending_request, replica_id, result)  # the prompt joins the replica's tree


class PowerOfTwoRouter(_PinnedRequests, PowerOfTwoChoicesRequestRouter):
    async def choose_replicas(self, candidate_replicas: list[Any], pending_request: Any = None) -> list[list[Any]]:
        pinned = self._pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        return await super().choose_replicas(candidate_replicas, pending_request)


def router_class(policy: str) -> type:
    return PrefixAwareRouter if policy == "prefix" else PowerOfTwoRouter
