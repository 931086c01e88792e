"""How wide the service runs on Ray Serve: replicas (fixed or autoscaled), CPUs, routing.

Importing this module does not import Ray: the CLI checks its flags before Ray starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import InvalidOptionError
from ...validation import positive_int

ROUTING_POLICIES = ("prefix", "power-of-two")  # see router.py
DEFAULT_TARGET_ONGOING = 8.0  # autoscaling: requests queued or running per replica


@dataclass(frozen=True)
class ReplicaOptions:
    """The model deployment's shape.

    ``replicas``: a fixed number of replicas; or ``min_replicas`` .. ``max_replicas`` for Serve's
    autoscaler, which adds a replica when the requests queued or running per replica exceed
    ``target_ongoing_requests`` and removes one below it. ``max_ongoing_requests``: requests a
    replica takes at once (its engine batches them); more wait in the ingress's router.
    ``routing``: "prefix" (a conversation returns to the replica holding its prefix while the
    replicas' queues differ by at most ``imbalanced_threshold``) or "power-of-two" (by load only).
    """

    replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None  # autoscaling only; default DEFAULT_TARGET_ONGOING
    max_ongoing_requests: int = 64
    cpus_per_replica: int = 1
    routing: str = "prefix"
    imbalanced_threshold: int = 8
    ingress_replicas: int = 1

    def __post_init__(self) -> None:
        if self.replicas is not None and (self.min_replicas is not None or self.max_replicas is not None):
            raise InvalidOptionError("--replicas is a fixed count: give it or --min-replicas/--max-replicas, not both")
        if self.min_replicas is not None and self.max_replicas is None:
            raise InvalidOptionError("--min-replicas needs --max-replicas (autoscaling between the two)")
        for name in ("replicas", "min_replicas", "max_replicas", "max_ongoing_requests", "cpus_per_replica",
                     "ingress_replicas"):
            if getattr(self, name) is not None:
                positive_int(getattr(self, name), f"--{name.replace('_', '-')}")
        if self.max_replicas is not None and self.max_replicas < (self.min_replicas or 1):
            raise InvalidOptionError(f"--max-replicas ({self.max_replicas}) is below --min-replicas "
                                     f"({self.min_replicas or 1})")
        target = self.target_ongoing_requests
        if target is not None:
            if not self.autoscaling:
                raise InvalidOptionError("--target-ongoing-requests steers the autoscaler: it needs --max-replicas")
            if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
                raise InvalidOptionError(f"--target-ongoing-requests must be a number > 0, got {target!r}")
        if self.routing not in ROUTING_POLICIES:
            raise InvalidOptionError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}, got {self.routing!r}")
        if not isinstance(self.imbalanced_threshold, int) or self.imbalanced_threshold < 0:
            raise InvalidOptionError(f"imbalanced_threshold must be an integer >= 0, got {self.imbalanced_threshold!r}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscaling else (self.replicas or 1)

    def deployment_options(self) -> dict[str, Any]:
        """``serve.deployment(...).options(...)`` for the model deployment (the router is added in app.py)."""
        options: dict[str, Any] = {"ray_actor_options": {"num_cpus": self.cpus_per_replica},
                                   "max_ongoing_requests": self.max_ongoing_requests}
        if self.autoscaling:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas or 1,
                                             "max_replicas": self.max_replicas,
                                             "target_ongoing_requests": self.target_ongoing_requests
                                             or DEFAULT_TARGET_ONGOING}
        else:
            options["num_replicas"] = self.replicas or 1
        return options

    def describe(self) -> str:
        count = (f"{self.min_replicas or 1}-{self.max_replicas} replicas (autoscaled)" if self.autoscaling
                 else f"{self.replicas or 1} replica{'s' if (self.replicas or 1) > 1 else ''}")
        return f"{count}, {self.cpus_per_replica} CPU each, {self.routing} routing"
