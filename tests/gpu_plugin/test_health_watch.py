"""The daemon's health wiring: faults from a source become republishes, coalesced, never one per event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from structlog.testing import capture_logs

from dra_driver.devices.faults import Fault, FaultKind, NodeFaults
from dra_driver.devices.types import Inventory
from dra_driver.gpu_plugin.watches import HealthWatch
from dra_driver.resources.taints import TaintPolicy
from dra_driver.simulated.gpus import SimulatedBackend
from tests.background import running

GUARD_S = 30  # against a hang only
INVENTORY: Inventory = SimulatedBackend("dgx-h100", "node-1", Path("/nonexistent")).inventory()
GPU_0, GPU_1 = INVENTORY.gpus[0].uuid, INVENTORY.gpus[1].uuid


def xid(number: int) -> Fault:
    return Fault(FaultKind.XID, since=1_800_000_000, xid=number)


class QueueSource:
    """A health source whose reports the test hands in."""

    def __init__(self) -> None:
        self.reports: asyncio.Queue[NodeFaults] = asyncio.Queue()

    async def watch(self) -> AsyncIterator[NodeFaults]:
        while True:
            yield await self.reports.get()


class Republishes:
    def __init__(self, watch: HealthWatch | None = None) -> None:
        self.seen: list[NodeFaults] = []
        self.watch = watch
        self.happened = asyncio.Event()

    def __call__(self) -> None:
        assert self.watch is not None
        self.seen.append(self.watch.tainted)
        self.happened.set()


def make_watch(source: QueueSource, republishes: Republishes, **policy: bool) -> HealthWatch:
    watch = HealthWatch(
        source, TaintPolicy(driver_name="gpu.dra-driver.dev", **policy), lambda: INVENTORY, republishes
    )
    republishes.watch = watch
    return watch


async def test_the_first_report_is_applied_before_anything_is_published() -> None:
    source, republishes = QueueSource(), Republishes()
    watch = make_watch(source, republishes)
    source.reports.put_nowait({GPU_0: (xid(79),)})
    await asyncio.wait_for(watch.start(), GUARD_S)
    assert watch.faults == watch.tainted == {GPU_0: (xid(79),)}
    assert republishes.seen == [{GPU_0: (xid(79),)}]


async def test_a_flood_of_reports_is_a_few_republishes_ending_in_the_latest_state() -> None:
    source, republishes = QueueSource(), Republishes()
    watch = make_watch(source, republishes)
    source.reports.put_nowait({})
    await watch.start()
    async with running(watch.run):
        for number in range(1, 501):
            source.reports.put_nowait({GPU_0: (xid(number),)})
        final = {GPU_0: (xid(500),), GPU_1: (xid(48),)}
        source.reports.put_nowait(final)
        while not republishes.seen or republishes.seen[-1] != final:
            republishes.happened.clear()
            await asyncio.wait_for(republishes.happened.wait(), GUARD_S)
    assert len(republishes.seen) < 20  # 501 reports


async def test_repeating_the_same_faults_republishes_nothing() -> None:
    source, republishes = QueueSource(), Republishes()
    watch = make_watch(source, republishes)
    source.reports.put_nowait({GPU_0: (xid(79),)})
    await watch.start()
    republishes.happened.clear()
    async with running(watch.run):
        source.reports.put_nowait({GPU_0: (xid(79),)})
        source.reports.put_nowait({GPU_0: (xid(79),), GPU_1: (xid(48),)})
        await asyncio.wait_for(republishes.happened.wait(), GUARD_S)
    assert republishes.seen == [{GPU_0: (xid(79),)}, {GPU_0: (xid(79),), GPU_1: (xid(48),)}]


async def test_taints_can_outlive_the_fault_while_the_faults_follow_the_gpu() -> None:
    source, republishes = QueueSource(), Republishes()
    watch = make_watch(source, republishes, remove_on_recovery=False)
    source.reports.put_nowait({GPU_0: (xid(79),)})
    await watch.start()
    republishes.happened.clear()
    async with running(watch.run):
        source.reports.put_nowait({})
        await asyncio.wait_for(republishes.happened.wait(), GUARD_S)
    assert watch.faults == {}
    assert watch.tainted == {GPU_0: (xid(79),)}


async def test_faults_of_a_gpu_the_node_does_not_have_are_logged_once() -> None:
    source, republishes = QueueSource(), Republishes()
    watch = make_watch(source, republishes)
    with capture_logs() as logs:
        source.reports.put_nowait({"GPU-elsewhere": (xid(79),)})
        await watch.start()
        republishes.happened.clear()
        async with running(watch.run):
            source.reports.put_nowait({"GPU-elsewhere": (xid(79),), GPU_0: (xid(48),)})
            await asyncio.wait_for(republishes.happened.wait(), GUARD_S)
    unknown = [entry for entry in logs if entry["event"].startswith("faults reported for GPUs the node")]
    assert [entry["gpus"] for entry in unknown] == [["GPU-elsewhere"]]
