"""The device-health stream (``DRAResourceHealth.NodeWatchResources``, v1alpha1 and v1).

The kubelet keeps a device's last reported health for 30 s (or the device's own
timeout) and then shows it as Unknown in the pod status, so every stream sends the
complete list at once, again on every change, and again at least every
``resend_interval`` seconds. Where the health comes from is a :class:`DeviceHealthFeed`;
:class:`HealthBoard` is the one the app keeps up to date.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc
import structlog

from dra_driver.devices.types import HealthState
from dra_driver.kubelet.pb.health.v1 import health_pb2 as v1
from dra_driver.kubelet.pb.health.v1 import health_pb2_grpc as v1_grpc
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2 as v1alpha1
from dra_driver.kubelet.pb.health.v1alpha1 import health_pb2_grpc as v1alpha1_grpc

log = structlog.get_logger(__name__)

DEFAULT_RESEND_INTERVAL_S = 10.0  # a third of the kubelet's default 30 s staleness timeout
MAX_MESSAGE_CHARS = 1024  # the kubelet's limit for DeviceHealth.message


@dataclass(frozen=True)
class DeviceHealthReport:
    """The health of one published device, as the kubelet is told it."""

    pool: str
    device: str
    state: HealthState
    last_updated: int  # unix seconds of the last change of state or message
    message: str = ""  # why the device is in this state; empty when healthy
    # How long the kubelet may trust this report without a new one; None = its default (30 s).
    timeout_seconds: int | None = None


@dataclass(frozen=True)
class HealthSnapshot:
    """All reports at one moment; ``version`` changes whenever any report does."""

    version: int
    devices: tuple[DeviceHealthReport, ...]


class DeviceHealthFeed(Protocol):
    def snapshot(self) -> HealthSnapshot: ...

    async def wait_changed(self, version: int) -> None:
        """Return as soon as the feed's version is no longer ``version`` (at once if it already is not).

        Waiting on a version rather than on "the next change" means a change that lands
        between taking a snapshot and starting to wait is never missed.
        """
        ...


class HealthBoard:
    """The current health of the devices this driver publishes, kept by the app.

    The app declares the devices with :meth:`set_devices` whenever it publishes them and
    reports checks with :meth:`mark`; health streams read it as a :class:`DeviceHealthFeed`.
    """

    def __init__(self, *, timeout_seconds: int | None = None, clock: Callable[[], float] = time.time) -> None:
        """``timeout_seconds``: sent with every device; ``clock``: unix time, for ``last_updated``."""
        self._timeout_seconds = timeout_seconds
        self._clock = clock
        self._devices: dict[tuple[str, str], DeviceHealthReport] = {}
        self._version = 0
        self._changed = asyncio.Event()

    def set_devices(
        self, pool: str, devices: Iterable[str], *, initial: HealthState = HealthState.HEALTHY
    ) -> None:
        """From now on report exactly ``devices``, all of them in ``pool`` (one pool per node).

        Devices already on the board keep their state (re-publishing must not make a
        broken GPU look healthy); new ones start as ``initial``; others are dropped.
        """
        now = self._now()
        updated: dict[tuple[str, str], DeviceHealthReport] = {}
        for name in devices:
            key = (pool, name)
            known = self._devices.get(key)
            updated[key] = known or DeviceHealthReport(
                pool, name, initial, now, timeout_seconds=self._timeout_seconds
            )
        if updated != self._devices:
            self._devices = updated
            self._bump()

    def mark(self, pool: str, device: str, state: HealthState, message: str = "") -> None:
        """Record the result of a health check of one device.

        Raises :class:`KeyError` for a device that :meth:`set_devices` did not declare.
        """
        key = (pool, device)
        if key not in self._devices:
            raise KeyError(
                f"device {pool}/{device} is not on the health board; declare it with set_devices first"
            )
        current = self._devices[key]
        if (current.state, current.message) != (state, message):
            self._devices[key] = replace(current, state=state, message=message, last_updated=self._now())
            self._bump()

    def snapshot(self) -> HealthSnapshot:
        return HealthSnapshot(self._version, tuple(self._devices[key] for key in sorted(self._devices)))

    async def wait_changed(self, version: int) -> None:
        while self._version == version:
            await self._changed.wait()

    def _bump(self) -> None:
        # Wake every waiter of this version, then give the next version a fresh event.
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _now(self) -> int:
        return int(self._clock())


class HealthStreams:
    """Drives every open health stream (one per kubelet connection) from one feed; ends them on stop."""

    def __init__(self, feed: DeviceHealthFeed, resend_interval: float = DEFAULT_RESEND_INTERVAL_S) -> None:
        self._feed = feed
        self._resend_interval = resend_interval
        self._closing = asyncio.Event()

    def close(self) -> None:
        """End every open stream (cleanly, with status OK), so that server shutdown need not wait."""
        self._closing.set()

    async def watch(self) -> AsyncIterator[tuple[DeviceHealthReport, ...]]:
        """The complete list now, after each change, and after ``resend_interval`` without one."""
        while not self._closing.is_set():
            snapshot = self._feed.snapshot()
            yield snapshot.devices
            await self._next_send(snapshot.version)

    async def _next_send(self, version: int) -> None:
        changed = asyncio.ensure_future(self._feed.wait_changed(version))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            done, _ = await asyncio.wait(
                (changed, closing), timeout=self._resend_interval, return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                task.result()  # a failing feed ends the stream with an error rather than silently
        finally:
            changed.cancel()
            closing.cancel()


def _wire_timeout(report: DeviceHealthReport) -> int:
    return report.timeout_seconds or 0  # 0 asks for the kubelet's default


_V1ALPHA1_STATUS = {
    HealthState.UNKNOWN: v1alpha1.UNKNOWN,
    HealthState.HEALTHY: v1alpha1.HEALTHY,
    HealthState.UNHEALTHY: v1alpha1.UNHEALTHY,
}
_V1_STATUS = {
    HealthState.UNKNOWN: v1.UNKNOWN,
    HealthState.HEALTHY: v1.HEALTHY,
    HealthState.UNHEALTHY: v1.UNHEALTHY,
}


def _v1alpha1_response(reports: Iterable[DeviceHealthReport]) -> v1alpha1.NodeWatchResourcesResponse:
    return v1alpha1.NodeWatchResourcesResponse(
        devices=[
            v1alpha1.DeviceHealth(
                device=v1alpha1.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                health=_V1ALPHA1_STATUS[r.state],
                last_updated_time=r.last_updated,
                health_check_timeout_seconds=_wire_timeout(r),
                message=r.message[:MAX_MESSAGE_CHARS],
            )
            for r in reports
        ]
    )


def _v1_response(reports: Iterable[DeviceHealthReport]) -> v1.NodeWatchResourcesResponse:
    return v1.NodeWatchResourcesResponse(
        devices=[
            v1.DeviceHealth(
                device=v1.DeviceIdentifier(pool_name=r.pool, device_name=r.device),
                health=_V1_STATUS[r.state],
                last_updated_time=r.last_updated,
                health_check_timeout_seconds=_wire_timeout(r),
                message=r.message[:MAX_MESSAGE_CHARS],
            )
            for r in reports
        ]
    )


class HealthV1Alpha1Servicer(v1alpha1_grpc.DRAResourceHealthServicer):
    """``v1alpha1.DRAResourceHealth``, watched by kubelets 1.34 to 1.36."""

    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    async def NodeWatchResources(
        self, request: v1alpha1.NodeWatchResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[v1alpha1.NodeWatchResourcesResponse]:
        log.info("kubelet started watching device health", api="v1alpha1")
        try:
            async for reports in self._streams.watch():
                yield _v1alpha1_response(reports)
        finally:
            log.info("kubelet stopped watching device health", api="v1alpha1")


class HealthV1Servicer(v1_grpc.DRAResourceHealthServicer):
    """``v1.DRAResourceHealth``, watched by kubelets 1.37 and newer."""

    def __init__(self, streams: HealthStreams) -> None:
        self._streams = streams

    async def NodeWatchResources(
        self, request: v1.NodeWatchResourcesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[v1.NodeWatchResourcesResponse]:
        log.info("kubelet started watching device health", api="v1")
        try:
            async for reports in self._streams.watch():
                yield _v1_response(reports)
        finally:
            log.info("kubelet stopped watching device health", api="v1")
