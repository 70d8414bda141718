"""Prometheus metrics of the daemon, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Prepare latency sits between ~1 ms (cached) and the kubelet's 45 s timeout.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 45.0)


class Metrics:
    """The metrics one plugin process exports on /metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "dra_driver_claim_operations",
            "Claims prepared or unprepared, by operation and result.",
            ["operation", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dra_driver_claim_operation_seconds",
            "Time to prepare or unprepare one claim.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.devices_published = Gauge(
            "dra_driver_devices_published",
            "Devices in the ResourceSlices of this node's pool.",
            registry=self.registry,
        )
        self.prepared_claims = Gauge(
            "dra_driver_prepared_claims", "Claims currently prepared on this node.", registry=self.registry
        )

    def prepare_done(self, seconds: float, ok: bool) -> None:
        self._done("prepare", seconds, ok)

    def unprepare_done(self, seconds: float, ok: bool) -> None:
        self._done("unprepare", seconds, ok)

    def _done(self, operation: str, seconds: float, ok: bool) -> None:
        self.requests.labels(operation, "success" if ok else "error").inc()
        self.latency.labels(operation).observe(seconds)
