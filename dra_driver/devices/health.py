"""Where a real node's GPU faults come from: NVML's events (a simulated node's: simulated/health.py).

A health source watches the node's GPUs and yields the node's faults as a whole
(:data:`NodeFaults`) at once and again after every change. What the faults mean for the
published devices (taints, the kubelet's health stream) is decided above this layer.

What a fault is: :mod:`dra_driver.devices.faults`.

How a fault ends differs by source. The simulator's state file says so (``dra-driver simulate
recover``). NVML sends no event when a GPU is repaired: a lost GPU counts as recovered, and all
its faults end, once NVML answers for it again (it was reset or re-attached); an Xid on a GPU
that was never lost lasts until the plugin restarts.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import pynvml
import structlog

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.faults import APPLICATION_XIDS, XID_MEANINGS, Fault, FaultKind, NodeFaults, carry_over
from dra_driver.devices.nvml import DEFAULT_CALL_TIMEOUT
from dra_driver.devices.nvml_calls import NvmlCalls, NvmlHungError

log = structlog.get_logger(__name__)

# NVML's "no GPU or compute instance": the event concerns the whole GPU.
_NO_INSTANCE = 0xFFFFFFFF
# Events taken from the event set in one go before the loop reports; a flood is drained in
# batches, so a report is never delayed behind an endless stream.
_EVENTS_PER_BATCH = 256


class HealthSource(Protocol):
    def watch(self) -> AsyncIterator[NodeFaults]:
        """The node's faults now, then again after every change; until cancelled.

        Errors while reading are logged and retried: the watch ends only by cancellation.
        """
        ...


class IgnoredXids:
    """Drops application Xids, logging each one once per GPU so that an operator can see why."""

    def __init__(self, ignored: Collection[int]) -> None:
        self._ignored = frozenset(ignored)
        self._logged: set[tuple[str, int]] = set()

    def critical(self, gpu_uuid: str, xid: int) -> bool:
        if xid not in self._ignored:
            return True
        if (gpu_uuid, xid) not in self._logged:
            self._logged.add((gpu_uuid, xid))
            log.info(
                "ignoring an application Xid",
                gpu=gpu_uuid,
                xid=xid,
                meaning=XID_MEANINGS.get(xid, ""),
                hint="the setting ignored-xids lists the Xids that do not make a GPU unhealthy",
            )
        return False


@dataclass
class _Registered:
    """The GPUs an NVML event set watches: uuid -> device handle, and those it cannot watch."""

    event_set: Any
    handles: dict[str, Any] = field(default_factory=dict)
    unmonitored: dict[str, str] = field(default_factory=dict)  # uuid -> why
    unidentified: dict[int, str] = field(default_factory=dict)  # NVML index -> why; retried every period


@dataclass(frozen=True)
class _XidEvent:
    gpu_uuid: str | None  # None: NVML could not say which GPU (it may be lost)
    xid: int
    gpu_instance: int | None


class NvmlHealthSource:
    """Critical Xid events from an NVML event set, and a check for lost GPUs every period.

    The blocking ``nvmlEventSetWait`` runs in a worker thread with a timeout of one period, so
    an event is reported as soon as it arrives and the loop still wakes up every period to
    check which GPUs NVML can reach. When the wait itself fails (``GPU_IS_LOST`` while a GPU is
    off the bus, or any other error), the rest of the period is waited out, so a lost GPU costs
    one wait per period, not a busy loop. NVML must already be initialised (by the backend).

    A GPU NVML cannot identify at start (no handle or uuid) is tried again every period; while
    it cannot be watched, the GPU that the backend's inventory knows at that index is reported
    as unmonitored (``known_gpus``: uuid by NVML index).

    Switching MIG mode may reset a GPU (nvml.h), which ends its event registrations: after the
    backend switched one (``mig_mode_switches`` counts), the GPUs are registered again in a new
    event set.

    Every NVML call runs bounded, one at a time (:mod:`dra_driver.devices.nvml_calls`): one that
    has not answered after ``call_timeout`` seconds is logged, and until it returns every GPU the
    watch knows is reported unmonitored, saying so; the watch goes on, and stops promptly when
    cancelled.
    """

    def __init__(
        self,
        *,
        ignored_xids: Collection[int] = APPLICATION_XIDS,
        poll_seconds: float = 0.5,
        clock: Callable[[], float] = time.time,
        known_gpus: Mapping[int, str] | None = None,
        mig_mode_switches: Callable[[], int] = lambda: 0,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self._ignored = IgnoredXids(ignored_xids)
        self._timeout_ms = max(1, int(poll_seconds * 1000))
        self._clock = clock
        self._known_gpus = dict(known_gpus or {})
        self._mig_mode_switches = mig_mode_switches
        self._nvml = NvmlCalls(call_timeout, one_at_a_time=True)

    async def watch(self) -> AsyncIterator[NodeFaults]:
        switches = self._mig_mode_switches()
        current: dict[str, tuple[Fault, ...]] | None = None
        registered: _Registered | None = None
        try:
            while registered is None:
                try:
                    registered = await self._nvml.run_async(
                        "registering the GPUs for Xid events", self._register
                    )
                except NvmlHungError as error:
                    observed = self._observed(_Registered(None), {}, set(), int(self._clock()), error)
                    latest = carry_over(current or {}, observed)
                    if latest != current:
                        current = latest
                        yield latest
                    await asyncio.sleep(self._timeout_ms / 1000)
            xids: dict[str, list[Fault]] = {}
            while True:
                hung: NvmlHungError | None = None
                try:
                    if self._mig_mode_switches() != switches:
                        fresh = await self._nvml.run_async(
                            "registering the GPUs for Xid events", self._register
                        )
                        switches = self._mig_mode_switches()
                        stale, registered = registered, fresh
                        await self._nvml.run_async(
                            "freeing an NVML event set", functools.partial(_free_event_set, stale.event_set)
                        )
                        log.info(
                            "a GPU switched MIG mode, which may reset it: its Xid events are registered again"
                        )
                    lost = await self._nvml.run_async(
                        "checking which GPUs NVML reaches", functools.partial(self._unreachable, registered)
                    )
                except NvmlHungError as error:
                    hung, lost = error, set()
                now = int(self._clock())
                for uuid in set(xids) - lost:
                    if (
                        hung is None
                        and current
                        and any(f.kind is FaultKind.GPU_LOST for f in current.get(uuid, ()))
                    ):
                        log.info("a lost GPU answers again: it was reset; its faults end", gpu=uuid)
                        del xids[uuid]
                observed = self._observed(registered, xids, lost, now, hung)
                latest = carry_over(current or {}, observed)
                if latest != current:
                    current = latest
                    yield latest
                try:
                    events = await self._nvml.run_async(
                        "waiting for NVML events",
                        functools.partial(self._next_events, registered),
                        extra_seconds=self._timeout_ms / 1000,
                    )
                    for event in events:
                        self._record(event, registered, xids, now=int(self._clock()))
                    if registered.unidentified:
                        await self._nvml.run_async(
                            "identifying GPUs", functools.partial(self._identify, registered)
                        )
                except NvmlHungError:
                    await asyncio.sleep(self._timeout_ms / 1000)  # reported at the next round
        finally:
            # A cancelled watch waits for its NVML call (an event wait: one period) before freeing
            # the event set the call may use; a hung call keeps the set, and stopping goes on.
            if registered is not None and await self._nvml.settled(self._timeout_ms / 1000 + 1):
                try:
                    await self._nvml.run_async(
                        "freeing an NVML event set", functools.partial(_free_event_set, registered.event_set)
                    )
                except NvmlHungError as error:
                    log.warning("the health watch's event set is not freed", error=str(error))
            elif registered is not None:
                log.warning("an NVML call of the health watch never returned; its event set is not freed")

    def _observed(
        self,
        registered: _Registered,
        xids: Mapping[str, list[Fault]],
        lost: Collection[str],
        now: int,
        hung: NvmlHungError | None = None,
    ) -> dict[str, list[Fault]]:
        observed: dict[str, list[Fault]] = {uuid: list(faults) for uuid, faults in xids.items()}
        for uuid, why in registered.unmonitored.items():
            observed.setdefault(uuid, []).append(Fault(FaultKind.UNMONITORED, since=now, detail=why))
        for uuid in lost:
            observed.setdefault(uuid, []).append(Fault(FaultKind.GPU_LOST, since=now))
        if hung is not None:
            # Which GPU hangs NVML is unknown, so every GPU's faults go unseen until it answers.
            for uuid in sorted({*registered.handles, *self._known_gpus.values()}):
                faults = observed.setdefault(uuid, [])
                if not any(f.kind is FaultKind.UNMONITORED for f in faults):
                    faults.append(Fault(FaultKind.UNMONITORED, since=now, detail=str(hung)))
        return observed

    def _record(
        self, event: _XidEvent, registered: _Registered, xids: dict[str, list[Fault]], *, now: int
    ) -> None:
        if event.gpu_uuid is None:
            log.warning(
                "an Xid event names a GPU NVML cannot identify; the lost-GPU check will find it",
                xid=event.xid,
            )
            return
        if event.gpu_uuid not in registered.handles:
            log.warning(
                "an Xid event names a GPU the driver does not know", gpu=event.gpu_uuid, xid=event.xid
            )
            return
        if not self._ignored.critical(event.gpu_uuid, event.xid):
            return
        known = xids.setdefault(event.gpu_uuid, [])
        if any(fault.xid == event.xid for fault in known):
            return  # the same fault again: a flood costs neither memory nor log lines
        detail = f"GPU instance {event.gpu_instance}" if event.gpu_instance is not None else ""
        log.warning(
            "critical Xid on a GPU",
            gpu=event.gpu_uuid,
            xid=event.xid,
            meaning=XID_MEANINGS.get(event.xid, ""),
            detail=detail,
        )
        known.append(Fault(FaultKind.XID, since=now, xid=event.xid, detail=detail))

    # --- in worker threads ---------------------------------------------------------------------------

    def _register(self) -> _Registered:
        try:
            registered = _Registered(event_set=pynvml.nvmlEventSetCreate())
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as error:
            raise DeviceError(f"cannot watch GPU health through NVML: {error}") from error
        for index in range(count):
            self._register_one(registered, index)
        for uuid, why in registered.unmonitored.items():
            log.warning("GPU health is not monitored", gpu=uuid, reason=why)
        return registered

    def _register_one(self, registered: _Registered, index: int) -> None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
        except pynvml.NVMLError as error:
            why = f"NVML does not identify it ({error}); trying again every period"
            if index not in registered.unidentified:
                log.error(
                    "a GPU cannot be watched yet", index=index, gpu=self._known_gpus.get(index), reason=why
                )
            registered.unidentified[index] = why
            if index in self._known_gpus:
                registered.unmonitored[self._known_gpus[index]] = why
            return
        registered.unidentified.pop(index, None)
        registered.unmonitored.pop(uuid, None)
        registered.handles[uuid] = handle
        try:
            supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not supported & pynvml.nvmlEventTypeXidCriticalError:
                registered.unmonitored[uuid] = "NVML offers no Xid events for this GPU"
                return
            pynvml.nvmlDeviceRegisterEvents(
                handle, pynvml.nvmlEventTypeXidCriticalError, registered.event_set
            )
        except pynvml.NVMLError as error:
            registered.unmonitored[uuid] = f"registering for Xid events failed: {error}"

    def _identify(self, registered: _Registered) -> None:
        """Try the GPUs NVML could not identify again; log the ones that are watched now."""
        for index in sorted(registered.unidentified):
            self._register_one(registered, index)
            if index not in registered.unidentified:
                log.info("a GPU is watched now", index=index, gpu=self._known_gpus.get(index))

    def _next_events(self, registered: _Registered) -> list[_XidEvent]:
        """Wait up to one period for events, then take what else is already queued."""
        events: list[_XidEvent] = []
        timeout = self._timeout_ms
        while len(events) < _EVENTS_PER_BATCH:
            try:
                data = pynvml.nvmlEventSetWait(registered.event_set, timeout)
            except pynvml.NVMLError_Timeout:
                break
            except pynvml.NVMLError as error:
                # GPU_IS_LOST (the lost-GPU check that follows finds which one) or another failure:
                # NVML answers at once, so the period is waited out here, not spun through.
                if not isinstance(error, pynvml.NVMLError_GpuIsLost):
                    log.warning("waiting for NVML events failed; retrying", error=str(error))
                if not events:
                    time.sleep(self._timeout_ms / 1000)
                break
            timeout = 0
            if data.eventType != pynvml.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid: str | None = pynvml.nvmlDeviceGetUUID(data.device)
            except pynvml.NVMLError:
                uuid = None
            gpu_instance = None if data.gpuInstanceId == _NO_INSTANCE else int(data.gpuInstanceId)
            events.append(_XidEvent(uuid, int(data.eventData), gpu_instance))
        return events

    @staticmethod
    def _unreachable(registered: _Registered) -> set[str]:
        """The GPUs NVML answers ``GPU_IS_LOST`` for."""
        lost = set()
        for uuid, handle in registered.handles.items():
            try:
                pynvml.nvmlDeviceGetMemoryInfo(handle)
            except pynvml.NVMLError_GpuIsLost:
                lost.add(uuid)
            except pynvml.NVMLError:
                pass  # an answer, if not a useful one: the GPU is reachable
        return lost


def _free_event_set(event_set: Any) -> None:
    try:
        pynvml.nvmlEventSetFree(event_set)
    except pynvml.NVMLError as error:
        log.warning("freeing the NVML event set failed", error=str(error))
