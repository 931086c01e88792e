"""Prometheus metrics of one server (its own registry: two servers in one process do not mix)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("fastdecode_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("fastdecode_prompt_tokens", "Prompt tokens of finished sequences", registry=r)
        self.cached_prompt_tokens = Counter("fastdecode_cached_prompt_tokens",
                                            "Prompt tokens served from the prefix cache (not run by the model)",
                                            registry=r)
        self.generated_tokens = Counter("fastdecode_generated_tokens", "Tokens generated", registry=r)
        self.waiting = Gauge("fastdecode_waiting_sequences", "Sequences submitted that have no token yet",
                             registry=r)
        self.running = Gauge("fastdecode_running_sequences", "Sequences generating", registry=r)
        self.ttft = Histogram("fastdecode_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("fastdecode_inter_token_latency_seconds", "Time between two tokens of a sequence",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
