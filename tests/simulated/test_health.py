"""Health sources: faults injected into the simulator; NVML's are in test_nvml_health.py, on the mock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.backends import open_health_source
from dra_driver.devices.health import Fault, FaultKind, NodeFaults, carry_over
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.health import SimulatedHealthSource

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
