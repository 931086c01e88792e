"""The ingress's /metrics: its own counters, then every replica's fastdecode metrics.

Ray Serve tags a deployment's metrics with the replica that recorded them; here too each
replica's series keep their names and gain a ``replica`` label (the id the
``x-fastdecode-replica`` header shows), so a dashboard sums them for the service or splits them
per replica. A replica that does not answer in time is left out (its series disappear, as a
scrape target that is down).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"


class IngressMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # `requests` has the labels of ServerMetrics.requests: the app's request guard counts into it.
        self.requests = Counter("fastdecode_ingress_requests", "HTTP requests the ingress answered, by endpoint "
                                "and status code", ["endpoint", "status"], registry=r)
        self.retries = Counter("fastdecode_ingress_retries", "Requests sent again after their replica failed "
                               "before answering", registry=r)
        self.replica_failures = Counter("fastdecode_ingress_replica_failures", "Requests whose replica died "
                                        "(each try counts)", registry=r)

    def render(self, replicas: dict[str, str]) -> bytes:
        """The ingress's metrics, then ``replicas`` (replica id -> its /metrics text) labelled."""
        return generate_latest(self.registry) + generate_latest(_Relabelled(replicas))


class _Relabelled:
    """A collector of parsed replica metrics: each family once, its samples from every replica."""

    def __init__(self, replicas: dict[str, str]):
        self.replicas = replicas

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.replicas.items()):
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                merged.samples += [Sample(s.name, {**s.labels, REPLICA_LABEL: replica}, s.value, s.timestamp,
                                          s.exemplar) for s in family.samples]
        return list(families.values())

    def describe(self) -> list[Metric]:
        return []
