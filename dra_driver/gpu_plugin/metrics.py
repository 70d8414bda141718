"""Prometheus metrics of the daemon, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dra_driver.node.claim_status import ClaimStatusWriter

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

    def follow(
        self, claim_status: ClaimStatusWriter, *, published: Callable[[], int], prepared: Callable[[], int]
    ) -> None:
        """Export the node's state: the claims' devices, the devices published, the claims prepared."""
        self.registry.register(ClaimDevicesCollector(claim_status))
        self.devices_published.set_function(published)
        self.prepared_claims.set_function(prepared)

    def prepare_done(self, seconds: float, ok: bool) -> None:
        self._done("prepare", seconds, ok)

    def unprepare_done(self, seconds: float, ok: bool) -> None:
        self._done("unprepare", seconds, ok)

    def _done(self, operation: str, seconds: float, ok: bool) -> None:
        self.requests.labels(operation, "success" if ok else "error").inc()
        self.latency.labels(operation).observe(seconds)


class ClaimDevicesCollector(Collector):
    """``dra_driver_claim_device_info``: which GPU or MIG device each prepared claim holds, and its health."""

    def __init__(self, writer: ClaimStatusWriter) -> None:
        self._writer = writer

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "dra_driver_claim_device_info",
            "A device prepared for a claim on this node: the GPU or MIG uuid behind it and whether it is "
            "healthy (True, False or Unknown), as in the claim's status.devices.",
            labels=["namespace", "claim", "claim_uid", "device", "uuid", "healthy"],
        )
        for row in self._writer.mapping():
            labels = [row.claim.namespace, row.claim.name, row.claim.uid, row.device, row.uuid, row.health]
            family.add_metric(labels, 1)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # no collect() at registration: the writer has nothing yet
