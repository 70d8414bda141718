"""status.devices of prepared claims: what is written, when it is written again, and what a failure does.

The writer is driven by a real NodePreparer on a simulated node; the API server is a recording
stand-in here, and the real one in e2e/test_claim_status.py.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import structlog

from dra_driver.devices.faults import Fault, FaultKind, NodeFaults
from dra_driver.devices.types import Inventory
from dra_driver.node.claim_status import (
    ALLOCATION_BYTES_REASON,
    ClaimStatusWriter,
    DeviceHardware,
    StatusWriteError,
    device_condition,
    hardware_of,
)
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice
from tests.background import running

from .builders import DRIVER, NODE, Node, new_ref

GUARD_S = 30  # against a hang only
T0 = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)


class RecordingApi:
    """The API server's status subresource: records what was applied; can fail the next writes."""

    def __init__(self) -> None:
        self.applied: list[tuple[ClaimRef, list[dict[str, Any]]]] = []
        self.failures: list[StatusWriteError] = []
        self.written = asyncio.Event()
        self.refused = asyncio.Event()

    async def apply_status(self, ref: ClaimRef, devices: list[dict[str, Any]], field_manager: str) -> None:
        assert field_manager == DRIVER
        if self.failures:
            self.refused.set()
            raise self.failures.pop(0)
        self.applied.append((ref, devices))
        self.written.set()

    async def next_write(self) -> tuple[ClaimRef, list[dict[str, Any]]]:
        await asyncio.wait_for(self.written.wait(), GUARD_S)
        self.written.clear()
        return self.applied[-1]


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class Health:
    def __init__(self) -> None:
        self.faults: NodeFaults = {}


def make_writer(
    node: Node, api: RecordingApi, health: Health, clock: Clock, **pacing: Any
) -> ClaimStatusWriter:
    return ClaimStatusWriter(
        api,
        driver_name=DRIVER,
        inventory=node.backend.inventory,
        faults=lambda: health.faults,
        clock=clock,
        retry_initial=0.01,
        retry_cap=0.02,
        **({"settle": 0.0} | pacing),
    )


def healthy_condition(since: datetime = T0) -> dict[str, Any]:
    return {
        "type": "Healthy",
        "status": "True",
        "reason": "NoFault",
        "message": "no fault reported for the GPU",
        "lastTransitionTime": since.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


async def test_a_prepared_claim_gets_its_gpus_uuid_and_health_in_its_status(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared, on_unprepared=writer.unprepared)
    ref = new_ref()
    node.allocate(ref, "gpu-1")
    async with running(writer.run):
        outcome = await preparer.prepare([ref])
        assert not isinstance(outcome[ref.uid], ClaimError)
        written_for, devices = await api.next_write()

    gpu = node.backend.inventory().gpus[1]
    assert written_for == ref
    assert devices == [
        {
            "driver": DRIVER,
            "pool": NODE,
            "device": "gpu-1",
            "data": {"uuid": gpu.uuid},
            "conditions": [healthy_condition()],
        }
    ]
    assert [(row.claim, row.device, row.uuid, row.health) for row in writer.mapping()] == [
        (ref, "gpu-1", gpu.uuid, "True")
    ]


async def test_a_mig_device_is_named_with_its_parent_gpu(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared)
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-1g10gb-19-3")
    async with running(writer.run):
        await preparer.prepare([ref])
        _, devices = await api.next_write()

    (gpu,) = [g for g in node.backend.inventory().gpus if g.minor == 0]
    (mig,) = gpu.mig_devices
    assert devices[0]["data"] == {"uuid": mig.uuid, "parentUUID": gpu.uuid}


async def test_a_health_change_is_written_again_and_only_then(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared, on_unprepared=writer.unprepared)
    ref, other = new_ref("a"), new_ref("b")
    node.allocate(ref, "gpu-2")
    node.allocate(other, "gpu-3")
    gpu_2 = node.backend.inventory().gpus[2]
    async with running(writer.run):
        await preparer.prepare([ref, other])
        while len(api.applied) < 2:
            await api.next_write()

        clock.now = T0 + timedelta(minutes=5)
        health.faults = {gpu_2.uuid: (Fault(FaultKind.XID, since=int(clock.now.timestamp()), xid=48),)}
        writer.health_changed()
        written_for, devices = await api.next_write()
        assert written_for == ref
        assert devices[0]["conditions"] == [
            {
                "type": "Healthy",
                "status": "False",
                "reason": "XidError",
                "message": "Xid 48 (double-bit ECC error) since 2027-01-15T08:05:00Z",
                "lastTransitionTime": "2027-01-15T08:05:00Z",
            }
        ]
        writer.health_changed()  # nothing changed for either claim: nothing is written
        await preparer.prepare([other])  # prepared again: the same status, not written again
        await asyncio.sleep(0)
        assert len(api.applied) == 3

        await preparer.unprepare([ref])
        health.faults = {}
        writer.health_changed()
        await asyncio.sleep(0)
    assert len(api.applied) == 3  # unprepared: its status is no longer this node's to write
    assert [row.claim for row in writer.mapping()] == [other]


async def test_failed_writes_are_retried_and_a_vanished_claim_is_given_up(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared)
    ref, gone = new_ref("a"), new_ref("gone")
    node.allocate(ref, "gpu-1")
    api.failures = [StatusWriteError(0, "connection refused"), StatusWriteError(503, "unavailable")]
    async with running(writer.run):
        await preparer.prepare([ref])
        written_for, _ = await api.next_write()
        assert written_for == ref

        node.allocate(gone, "gpu-2")
        api.failures = [StatusWriteError(404, "not found")]
        api.refused.clear()
        await preparer.prepare([gone])
        await asyncio.wait_for(api.refused.wait(), GUARD_S)
        await asyncio.sleep(0.1)  # no retry is scheduled: it would come within 0.02 s
        assert len(api.applied) == 1
        writer.health_changed()  # a later occasion to write: the 404 ended that attempt only
        _, devices = await api.next_write()
    assert not api.failures
    assert devices[0]["device"] == "gpu-2"


# How Kubernetes 1.37 and 1.36 refuse a status write of a claim allocated with an opaque config in
# bytes other than Go's own JSON (e2e/test_claim_status.py shows it on the real API server).
ALLOCATION_REFUSALS = [
    'ResourceClaim.resource.k8s.io "a" is invalid: status.allocation: Invalid value: null: '
    "field cannot be modified once set",
    'ResourceClaim.resource.k8s.io "a" is invalid: status.allocation: Invalid value: '
    '{"Devices":{"Results":[]}}: field is immutable',
]


@pytest.mark.parametrize("message", ALLOCATION_REFUSALS, ids=["1.37", "1.36"])
async def test_a_claim_whose_allocation_the_server_calls_changed_is_tried_once_and_logged_with_why(
    node: Node, message: str
) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared)
    ref = new_ref("a")
    node.allocate(ref, "gpu-1")
    api.failures = [StatusWriteError(422, f"apply status of ResourceClaim default/a: HTTP 422: {message}")]
    with structlog.testing.capture_logs() as logs:
        async with running(writer.run):
            await preparer.prepare([ref])
            await asyncio.wait_for(api.refused.wait(), GUARD_S)
            clock.now = T0 + timedelta(minutes=5)
            gpu_1 = node.backend.inventory().gpus[1]
            health.faults = {gpu_1.uuid: (Fault(FaultKind.XID, since=int(clock.now.timestamp()), xid=48),)}
            writer.health_changed()  # another occasion to write: not taken, the server never will
            await asyncio.sleep(0.1)
    assert api.applied == []
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "claim status not written, and never will be"
    assert warning["reason"] == ALLOCATION_BYTES_REASON
    assert "kubectl" in warning["reason"]


async def test_other_refusals_of_the_content_are_not_given_that_reason(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)
    preparer = await node.started(on_prepared=writer.prepared)
    ref = new_ref("a")
    node.allocate(ref, "gpu-1")
    api.failures = [StatusWriteError(422, "HTTP 422: metadata.uid: Invalid value: precondition failed")]
    with structlog.testing.capture_logs() as logs:
        async with running(writer.run):
            await preparer.prepare([ref])
            await asyncio.wait_for(api.refused.wait(), GUARD_S)
            writer.health_changed()  # the uid may be right at the next occasion: written then
            await api.next_write()
    (warning,) = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["event"] == "claim status not written; giving up"
    assert "reason" not in warning


async def test_a_write_never_delays_or_fails_the_prepare(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock)  # never run: nothing is written at all
    preparer = await node.started(on_prepared=writer.prepared)
    ref = new_ref()
    node.allocate(ref, "gpu-1")
    outcome = await asyncio.wait_for(preparer.prepare([ref]), GUARD_S)
    assert isinstance(outcome[ref.uid], tuple)
    assert api.applied == []


async def test_writes_wait_for_a_pause_in_the_claim_operations(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    busy = True
    writer = make_writer(node, api, health, clock, settle=0.05, busy=lambda: busy)
    preparer = await node.started(on_prepared=writer.prepared, on_unprepared=writer.unprepared)
    ref, short_lived = new_ref("a"), new_ref("short")
    node.allocate(ref, "gpu-1")
    node.allocate(short_lived, "gpu-2")
    async with running(writer.run):
        await preparer.prepare([ref])
        await asyncio.sleep(0.3)  # the kubelet's calls go on (busy): the write waits
        assert api.applied == []

        busy = False
        written_for, _ = await api.next_write()
        assert written_for == ref

        await preparer.prepare([short_lived])
        await preparer.unprepare([short_lived])  # within the settle time: never written
        await asyncio.sleep(0.3)
    assert [written_for for written_for, _ in api.applied] == [ref]


async def test_a_node_that_is_never_quiet_still_gets_its_statuses(node: Node) -> None:
    api, health, clock = RecordingApi(), Health(), Clock()
    writer = make_writer(node, api, health, clock, settle=0.05, max_delay=0.2, busy=lambda: True)
    preparer = await node.started(on_prepared=writer.prepared)
    ref = new_ref()
    node.allocate(ref, "gpu-1")
    async with running(writer.run):
        await preparer.prepare([ref])
        written_for, _ = await api.next_write()
    assert written_for == ref


async def test_the_claims_of_the_store_are_listed_for_a_restarted_plugin(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-1")
    await preparer.prepare([ref])
    restarted = await node.started()
    cdi_ids = node.on_disk().claims[ref.uid].devices[0].cdi_device_ids
    assert restarted.prepared() == [(ref, (PreparedDevice(("gpu",), NODE, "gpu-1", cdi_ids),))]


# --- pure parts ----------------------------------------------------------------------------------


def test_hardware_of_a_device_the_node_no_longer_has_is_none(node: Node) -> None:
    inventory = node.backend.inventory()
    assert hardware_of(inventory, "gpu-0") == DeviceHardware(inventory.gpus[0].uuid)
    assert hardware_of(inventory, "gpu-0-mig-1g10gb-19-3") is None  # a placement, not created
    assert hardware_of(inventory, "gpu-99") is None


def test_conditions_name_the_worst_fault_and_a_vanished_device(node: Node) -> None:
    inventory: Inventory = node.backend.inventory()
    uuid_0, uuid_1 = inventory.gpus[0].uuid, inventory.gpus[1].uuid
    faults = {
        uuid_0: (Fault(FaultKind.XID, since=0, xid=79), Fault(FaultKind.GPU_LOST, since=0)),
        uuid_1: (Fault(FaultKind.UNMONITORED, since=0, detail="no events"),),
    }
    assert device_condition(inventory, faults, "gpu-0").reason == "GpuLost"
    assert device_condition(inventory, faults, "gpu-0-mig-1g10gb-19-3").status == "False"
    unmonitored = device_condition(inventory, faults, "gpu-1")
    assert (unmonitored.status, unmonitored.reason) == ("Unknown", "Unmonitored")
    gone = device_condition(inventory, faults, "gpu-42")
    assert (gone.status, gone.reason) == ("Unknown", "NotFound")
