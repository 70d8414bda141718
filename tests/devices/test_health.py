"""Health sources: faults injected into the simulator, and NVML's Xid events against a fake of the GPU."""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml
import pytest
from structlog.testing import capture_logs

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.health import (
    Fault,
    FaultKind,
    NodeFaults,
    NvmlHealthSource,
    SimulatedHealthSource,
    carry_over,
    open_health_source,
)
from dra_driver.devices.simulated import SimulatedBackend

GUARD_S = 30  # against a hang only
T0 = 1_800_000_000


class Clock:
    def __init__(self) -> None:
        self.now = float(T0)

    def __call__(self) -> float:
        return self.now


def xid(number: int, since: int = T0, detail: str = "") -> Fault:
    return Fault(FaultKind.XID, since=since, xid=number, detail=detail)


async def next_report(updates: AsyncIterator[NodeFaults]) -> NodeFaults:
    return await asyncio.wait_for(anext(updates), GUARD_S)


# --- carrying faults over ------------------------------------------------------------------------


def test_a_fault_that_persists_keeps_the_time_it_was_first_seen() -> None:
    previous = {"GPU-a": (xid(48, since=T0),)}
    observed = {"GPU-a": [xid(48, since=T0 + 60), xid(79, since=T0 + 60)], "GPU-b": []}
    assert carry_over(previous, observed) == {"GPU-a": (xid(48, since=T0), xid(79, since=T0 + 60))}


def test_the_same_xid_seen_many_times_is_one_fault() -> None:
    observed = {"GPU-a": [xid(79, since=T0 + i) for i in range(1000)]}
    assert carry_over({}, observed) == {"GPU-a": (xid(79, since=T0),)}


def test_a_fault_that_ends_and_comes_back_is_new() -> None:
    assert carry_over({}, {"GPU-a": [xid(79, since=T0 + 5)]}) == {"GPU-a": (xid(79, since=T0 + 5),)}


def test_describing_a_fault_names_the_xid_and_what_it_means() -> None:
    assert xid(79).describe() == "Xid 79 (GPU has fallen off the bus)"
    assert xid(48, detail="GPU instance 3").describe() == "Xid 48 (double-bit ECC error): GPU instance 3"
    assert xid(4242).describe() == "Xid 4242 (see NVIDIA's Xid catalog)"


# --- the simulator -------------------------------------------------------------------------------


@pytest.fixture
def simulated(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend("dgx-h100", "node-1", tmp_path, boot_id_path=tmp_path / "boot_id")


@pytest.fixture
async def simulated_updates(
    simulated: SimulatedBackend,
) -> AsyncIterator[tuple[AsyncIterator[NodeFaults], Clock]]:
    clock = Clock()
    source = SimulatedHealthSource(simulated, poll_seconds=0.01, clock=clock)
    updates = source.watch()
    yield updates, clock
    await updates.aclose()  # type: ignore[attr-defined]


async def test_simulated_faults_are_reported_at_once_and_again_when_they_change(
    simulated: SimulatedBackend, simulated_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, clock = simulated_updates
    assert await next_report(updates) == {}  # the first report comes at once, even when all is well

    uuid = simulated.inventory().gpus[3].uuid
    await asyncio.to_thread(simulated.inject_xid, 3, 79)
    assert await next_report(updates) == {uuid: (xid(79, since=T0),)}

    clock.now += 30
    await asyncio.to_thread(simulated.inject_xid, 3, 48)
    assert await next_report(updates) == {uuid: (xid(79, since=T0), xid(48, since=T0 + 30))}

    await asyncio.to_thread(simulated.recover, 3)
    assert await next_report(updates) == {}


async def test_a_flood_of_one_xid_changes_nothing_after_the_first(
    simulated: SimulatedBackend, simulated_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = simulated_updates
    await next_report(updates)
    uuid = simulated.inventory().gpus[0].uuid

    def flood() -> None:
        for _ in range(200):
            simulated.inject_xid(0, 94)
        simulated.inject_xid(0, 95)  # the one change after the flood

    await asyncio.to_thread(flood)
    reports = [await next_report(updates)]
    while len(reports[-1].get(uuid, ())) < 2:
        reports.append(await next_report(updates))
    assert reports[-1] == {uuid: (xid(94), xid(95))}
    assert len(reports) <= 2  # 201 events, at most one report per state seen


async def test_application_xids_are_ignored_and_logged_once(
    simulated: SimulatedBackend, simulated_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = simulated_updates
    await next_report(updates)
    uuid = simulated.inventory().gpus[1].uuid
    with capture_logs() as logs:
        for number in (13, 31, 13, 79):
            await asyncio.to_thread(simulated.inject_xid, 1, number)
        assert await next_report(updates) == {uuid: (xid(79),)}
    ignored = [entry["xid"] for entry in logs if entry["event"] == "ignoring an application Xid"]
    assert sorted(ignored) == [13, 31]


async def test_a_custom_list_of_ignored_xids_is_honoured(simulated: SimulatedBackend) -> None:
    source = SimulatedHealthSource(simulated, ignored_xids=[79], poll_seconds=0.01, clock=Clock())
    updates = source.watch()
    await next_report(updates)
    await asyncio.to_thread(simulated.inject_xid, 2, 79)
    await asyncio.to_thread(simulated.inject_xid, 2, 13)  # an application Xid by default, not here
    uuid = simulated.inventory().gpus[2].uuid
    assert await next_report(updates) == {uuid: (xid(13),)}
    await updates.aclose()  # type: ignore[attr-defined]


class OnceUnreadable(SimulatedBackend):
    """A simulator whose state file cannot be read the second time it is asked."""

    reads = 0

    def faults(self) -> dict[str, tuple[int, ...]]:
        self.reads += 1
        if self.reads == 2:
            raise DeviceError("simulated GPU state is unreadable")
        return super().faults()


async def test_an_unreadable_state_file_is_logged_and_read_again(tmp_path: Path) -> None:
    backend = OnceUnreadable("dgx-h100", "node-1", tmp_path, boot_id_path=tmp_path / "boot_id")
    updates = SimulatedHealthSource(backend, poll_seconds=0.01, clock=Clock()).watch()
    assert await next_report(updates) == {}
    await asyncio.to_thread(backend.inject_xid, 5, 79)
    with capture_logs() as logs:
        report = await next_report(updates)
    assert report == {backend.inventory().gpus[5].uuid: (xid(79),)}
    assert backend.reads >= 3
    assert [entry["error"] for entry in logs if entry["log_level"] == "warning"] == [
        "simulated GPU state is unreadable"
    ]
    await updates.aclose()  # type: ignore[attr-defined]


def test_each_backend_gets_its_own_source(simulated: SimulatedBackend) -> None:
    assert isinstance(open_health_source(simulated), SimulatedHealthSource)


# --- NVML ----------------------------------------------------------------------------------------


@dataclass
class FakeHandle:
    uuid: str
    xid_events: bool = True
    lost: bool = False


@dataclass
class FakeEvent:
    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeNvml:
    """The event-set part of NVML, answering like GPUs that raise Xids and fall off the bus would."""

    gpus: list[FakeHandle]
    events: queue.Queue[FakeEvent] = field(default_factory=queue.Queue)
    registered: list[str] = field(default_factory=list)
    waiting: threading.Event = field(default_factory=threading.Event)
    freed_while_waiting: bool | None = None
    _in_wait: int = 0

    def raise_xid(self, gpu: int, number: int, gpu_instance: int = 0xFFFFFFFF) -> None:
        self.events.put(
            FakeEvent(
                self.gpus[gpu], pynvml.nvmlEventTypeXidCriticalError, number, gpuInstanceId=gpu_instance
            )
        )

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        return self.gpus[index]

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        if handle.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return handle.uuid

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        return pynvml.nvmlEventTypeXidCriticalError if handle.xid_events else pynvml.nvmlEventTypePState

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, types: int, event_set: str) -> None:
        assert (event_set, types) == ("event-set", pynvml.nvmlEventTypeXidCriticalError)
        self.registered.append(handle.uuid)

    def nvmlEventSetWait(self, event_set: str, timeout_ms: int) -> FakeEvent:
        self._in_wait += 1
        self.waiting.set()
        try:
            return self.events.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT) from None
        finally:
            self._in_wait -= 1

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.freed_while_waiting = self._in_wait > 0

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle) -> object:
        if handle.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return object()


def _forbidden(name: str) -> Any:
    def call(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the health source must not call pynvml.{name}")

    return call


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    fake = FakeNvml([FakeHandle("GPU-0"), FakeHandle("GPU-1"), FakeHandle("GPU-2", xid_events=False)])
    for name in dir(pynvml):
        if name.startswith("nvml") and inspect.isfunction(getattr(pynvml, name)):
            monkeypatch.setattr(pynvml, name, getattr(fake, name, _forbidden(name)))
    return fake


@pytest.fixture
async def nvml_updates(nvml: FakeNvml) -> AsyncIterator[tuple[AsyncIterator[NodeFaults], Clock]]:
    clock = Clock()
    updates = NvmlHealthSource(poll_seconds=0.02, clock=clock).watch()
    yield updates, clock
    await updates.aclose()  # type: ignore[attr-defined]


UNMONITORED = Fault(FaultKind.UNMONITORED, since=T0, detail="NVML offers no Xid events for this GPU")


async def test_a_gpu_without_xid_events_is_reported_unmonitored(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = nvml_updates
    assert await next_report(updates) == {"GPU-2": (UNMONITORED,)}
    assert nvml.registered == ["GPU-0", "GPU-1"]


async def test_critical_xids_are_faults_and_application_xids_are_not(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, clock = nvml_updates
    await next_report(updates)
    clock.now += 10
    for number in (13, 43, 48):
        nvml.raise_xid(1, number, gpu_instance=3)
    assert await next_report(updates) == {
        "GPU-1": (xid(48, since=T0 + 10, detail="GPU instance 3"),),
        "GPU-2": (UNMONITORED,),
    }


async def test_a_burst_of_events_is_reported_and_logged_once_per_fault(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = nvml_updates
    await next_report(updates)
    with capture_logs() as logs:
        for _ in range(1000):
            nvml.raise_xid(0, 94)
        nvml.raise_xid(0, 95)
        report = await next_report(updates)
        while len(report.get("GPU-0", ())) < 2:
            report = await next_report(updates)
    assert report["GPU-0"] == (xid(94), xid(95))
    assert [entry["xid"] for entry in logs if entry["event"] == "critical Xid on a GPU"] == [94, 95]


async def test_an_event_for_a_gpu_the_driver_does_not_know_is_logged_and_ignored(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = nvml_updates
    await next_report(updates)
    with capture_logs() as logs:
        nvml.events.put(FakeEvent(FakeHandle("GPU-stranger"), pynvml.nvmlEventTypeXidCriticalError, 79))
        nvml.raise_xid(0, 79)  # a known one after it, to know the first was handled
        report = await next_report(updates)
    assert report.keys() == {"GPU-0", "GPU-2"}
    (warning,) = [
        entry for entry in logs if entry["event"] == "an Xid event names a GPU the driver does not know"
    ]
    assert warning["gpu"] == "GPU-stranger"


async def test_a_lost_gpu_is_reported_and_recovers_with_all_its_faults_once_it_answers(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = nvml_updates
    await next_report(updates)
    nvml.raise_xid(0, 79)
    assert (await next_report(updates))["GPU-0"] == (xid(79),)
    nvml.gpus[0].lost = True
    lost = Fault(FaultKind.GPU_LOST, since=T0)
    assert (await next_report(updates))["GPU-0"] == (xid(79), lost)
    nvml.gpus[0].lost = False  # reset by an administrator
    assert await next_report(updates) == {"GPU-2": (UNMONITORED,)}


async def test_an_xid_on_a_gpu_that_was_never_lost_lasts(
    nvml: FakeNvml, nvml_updates: tuple[AsyncIterator[NodeFaults], Clock]
) -> None:
    updates, _ = nvml_updates
    await next_report(updates)
    nvml.raise_xid(1, 48)
    assert (await next_report(updates))["GPU-1"] == (xid(48),)
    nvml.gpus[0].lost = True  # another GPU changes, so a report follows
    report = await next_report(updates)
    assert report["GPU-1"] == (xid(48),)


async def test_stopping_frees_the_event_set_only_after_the_wait_returned(nvml: FakeNvml) -> None:
    updates = NvmlHealthSource(poll_seconds=0.5, clock=Clock()).watch()

    async def consume() -> None:
        async for _ in updates:
            pass

    task = asyncio.create_task(consume())
    await asyncio.to_thread(nvml.waiting.wait, GUARD_S)  # the worker thread now blocks in the wait
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert nvml.freed_while_waiting is False
