"""Dynamic MIG end to end in the node layer: prepare creates the MIG device the scheduler chose, unprepare
destroys it, and a restart repairs what a crash left half done.

The GPUs are the simulated backend, which refuses what the hardware refuses (overlapping placements,
MIG mode switches that need a reset, destroying a device in use), so a wrong step fails here as it
would on a node. The simulated node has two H100s (gpu-0, gpu-1: MIG mode switches without a reset),
two A100-40GBs (gpu-2, gpu-3: MIG mode needs a reset) and two L4s (gpu-4, gpu-5: no MIG).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices.types import Inventory, MigDevice, Placement
from dra_driver.gpu_plugin.policies import desired_slices
from dra_driver.node.config import API_VERSION
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.records import (
    ClaimRecord,
    DeviceRecord,
    MigRecord,
    MutationRejected,
    Phase,
    StoreWriteError,
)
from dra_driver.node.store import Progress, Reserve, Store, open_store
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice
from dra_driver.resources.devices import partition_selected
from dra_driver.settings import Settings
from dra_driver.simulated.gpus import SimulatedBackend

from .builders import DRIVER, NODE, InMemoryClaims, Node, RecordingObserver, new_ref, opaque

KIND = f"k8s.{DRIVER}/claim"
H100 = 0  # index (= minor) of the first simulated H100
A100 = 2
L4 = 4


def devices_of(outcome: object) -> tuple[PreparedDevice, ...]:
    assert isinstance(outcome, tuple), outcome
    return outcome


def error_of(outcome: object) -> str:
    assert isinstance(outcome, ClaimError), outcome
    return outcome.message


def live_migs(node: Node, gpu: int = H100) -> list[tuple[str, int]]:
    """The MIG devices on a GPU as (profile, first memory slice), as `nvidia-smi mig -lgi` shows them."""
    return sorted((m.profile, m.placement.start) for m in node.backend.inventory().gpus[gpu].mig_devices)


def mig_device(node: Node, uuid: str) -> MigDevice:
    return next(m for gpu in node.backend.inventory().gpus for m in gpu.mig_devices if m.uuid == uuid)


def spec_device(node: Node, uid: str, device: str) -> dict[str, Any]:
    spec = json.loads(node.specs.path_for(uid).read_text())
    found: dict[str, Any] = next(d for d in spec["devices"] if d["name"] == f"{uid}-{device}")
    return found


def recorded_mig(node: Node, uid: str, index: int = 0) -> MigRecord:
    mig = node.on_disk().claims[uid].devices[index].mig
    assert mig is not None
    return mig


def assert_nothing_left_for(node: Node, uid: str) -> None:
    assert not node.specs.path_for(uid).exists()
    if node.store_path.exists():
        assert uid not in node.on_disk().claims


# --- prepare creates, unprepare destroys ---------------------------------------------------------------


async def test_prepare_creates_the_mig_device_at_exactly_the_allocated_placement(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-4")

    outcome = await preparer.prepare([ref])

    assert devices_of(outcome[ref.uid]) == (
        PreparedDevice(("gpu",), NODE, "gpu-0-mig-3g40gb-9-4", (f"{KIND}={ref.uid}-gpu-0-mig-3g40gb-9-4",)),
    )
    assert live_migs(node) == [("3g.40gb", 4)]
    mig = recorded_mig(node, ref.uid)
    created = mig_device(node, mig.uuid or "")
    assert (mig.parent_uuid, mig.parent_device, mig.profile_id) == (created.parent_uuid, "gpu-0", 9)
    assert (mig.placement_start, mig.placement_size) == (4, 4)
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert preparer.owned_mig_uuids() == {created.uuid}


async def test_the_cdi_spec_gives_the_parent_gpu_and_the_mig_capabilities(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-1-mig-1g10gb-19-6")

    await preparer.prepare([ref])

    created = mig_device(node, recorded_mig(node, ref.uid).uuid or "")
    edits = spec_device(node, ref.uid, "gpu-1-mig-1g10gb-19-6")["containerEdits"]
    assert [(n["path"], n["major"], n["minor"]) for n in edits["deviceNodes"]] == [
        ("/dev/nvidia1", 195, 1),
        *((cap.path, cap.major, cap.minor) for cap in created.cap_nodes),
    ]
    assert len(created.cap_nodes) == 2
    assert f"DRA_GPU_UUID_GPU_1_MIG_1G10GB_19_6={created.uuid}" in edits["env"]
    assert "DRA_GPU_SHARING_STRATEGY_GPU_1_MIG_1G10GB_19_6=Exclusive" in edits["env"]


async def test_unprepare_destroys_the_mig_device_and_gives_the_full_gpu_back(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-2g20gb-14-2")
    await preparer.prepare([ref])
    assert node.backend.inventory().gpus[H100].mig_enabled

    assert await preparer.unprepare([ref]) == {ref.uid: None}

    gpu = node.backend.inventory().gpus[H100]
    assert (gpu.mig_devices, gpu.mig_enabled) == ((), False)  # Hopper switches MIG mode off again
    assert_nothing_left_for(node, ref.uid)
    assert preparer.owned_mig_uuids() == frozenset()
    whole = new_ref("whole")
    node.allocate(whole, "gpu-0")
    devices_of((await preparer.prepare([whole]))[whole.uid])


async def test_seven_1g_claims_fill_an_h100_side_by_side(node: Node) -> None:
    preparer = await node.started()
    refs = [new_ref(f"small-{start}") for start in range(7)]
    for start, ref in enumerate(refs):
        node.allocate(ref, f"gpu-0-mig-1g10gb-19-{start}")

    outcomes = await preparer.prepare(refs)  # concurrently: the GPU's MIG operations take turns

    assert all(isinstance(o, tuple) for o in outcomes.values()), outcomes
    assert live_migs(node) == [("1g.10gb", start) for start in range(7)]
    assert len(preparer.owned_mig_uuids()) == 7
    assert await preparer.unprepare(refs) == dict.fromkeys((r.uid for r in refs), None)
    assert live_migs(node) == []


async def test_mixed_profiles_on_one_gpu_get_the_placements_the_scheduler_chose(node: Node) -> None:
    preparer = await node.started()
    big, medium, small = new_ref("big"), new_ref("medium"), new_ref("small")
    node.allocate(big, "gpu-0-mig-3g40gb-9-4")
    node.allocate(medium, "gpu-0-mig-2g20gb-14-0")
    node.allocate(small, "gpu-0-mig-1g10gb-19-2")

    outcomes = await preparer.prepare([big, medium, small])

    assert all(isinstance(o, tuple) for o in outcomes.values()), outcomes
    assert live_migs(node) == [("1g.10gb", 2), ("2g.20gb", 0), ("3g.40gb", 4)]


async def test_one_claim_with_two_mig_devices_on_two_gpus(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-7g80gb-0-0", "gpu-1-mig-4g40gb-5-0")

    devices_of((await preparer.prepare([ref]))[ref.uid])

    assert live_migs(node, 0) == [("7g.80gb", 0)]
    assert live_migs(node, 1) == [("4g.40gb", 0)]
    assert {recorded_mig(node, ref.uid, i).parent_device for i in (0, 1)} == {"gpu-0", "gpu-1"}


async def test_repeated_prepare_uses_the_mig_device_it_created(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-1g20gb-15-2")
    first = await (await node.started()).prepare([ref])
    node.specs.path_for(ref.uid).unlink()  # someone cleaned /var/run/cdi; the next prepare plans again

    again = await (await node.started()).prepare([ref])  # a restarted plugin

    assert again == first
    assert live_migs(node) == [("1g.20gb", 2)]  # no second instance
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"


async def test_config_for_the_parent_request_applies_to_the_chosen_subrequest(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    mps = {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}
    # firstAvailable: [full, mig-3g, mig-1g]; the scheduler settled on "gpu/mig-3g".
    node.allocate(ref, "gpu-1-mig-3g40gb-9-0", request="gpu/mig-3g", configs=[opaque(mps, requests=["gpu"])])

    (device,) = devices_of((await preparer.prepare([ref]))[ref.uid])

    assert device.requests == ("gpu",)  # the kubelet matches containers against the parent request
    env = spec_device(node, ref.uid, "gpu-1-mig-3g40gb-9-0")["containerEdits"]["env"]
    assert "DRA_GPU_SHARING_STRATEGY_GPU_1_MIG_3G40GB_9_0=MPS" in env
    assert node.on_disk().claims[ref.uid].devices[0].request == "gpu/mig-3g"


async def test_every_mig_change_is_reported_with_the_inventory_after_it(node: Node) -> None:
    seen: list[Inventory] = []
    preparer = await node.started(on_inventory_changed=seen.append)
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0")

    await preparer.prepare([ref])
    await preparer.unprepare([ref])

    assert [[(m.profile, m.placement.start) for m in inv.gpus[H100].mig_devices] for inv in seen] == [
        [("3g.40gb", 0)],
        [],
    ]


async def test_after_a_burst_of_changes_the_last_report_shows_all_of_them(node: Node) -> None:
    seen: list[Inventory] = []
    preparer = await node.started(on_inventory_changed=seen.append)
    refs = [new_ref(f"small-{start}") for start in range(7)]
    for start, ref in enumerate(refs):
        node.allocate(ref, f"gpu-0-mig-1g10gb-19-{start}")

    await preparer.prepare(refs)

    assert 1 <= len(seen) <= 7
    assert sorted(m.placement.start for m in seen[-1].gpus[H100].mig_devices) == list(range(7))


async def test_published_slices_keep_the_created_device_as_its_placement(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0")
    await preparer.prepare([ref])

    slices = desired_slices(Settings(node_name=NODE), node.backend.inventory(), preparer.owned_mig_uuids())

    devices = {d["name"]: d for content in slices for d in content.devices}
    assert "gpu-0" not in devices  # MIG mode is on: CUDA cannot use the GPU whole
    placement = devices["gpu-0-mig-3g40gb-9-0"]
    assert "uuid" not in placement["attributes"]  # still the placement the claim was allocated
    assert "consumesCounters" in placement
    assert "gpu-1" in devices


# --- static MIG and admin access -------------------------------------------------------------------------


async def test_a_static_mig_device_is_used_as_it_is_and_kept(node: Node) -> None:
    static = node.backend.admin_create_mig(H100, "3g.40gb", 0)
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0")

    devices_of((await preparer.prepare([ref]))[ref.uid])
    env = spec_device(node, ref.uid, "gpu-0-mig-3g40gb-9-0")["containerEdits"]["env"]
    await preparer.unprepare([ref])

    assert f"DRA_GPU_UUID_GPU_0_MIG_3G40GB_9_0={static.uuid}" in env
    assert node.on_disk().claims == {}
    assert [m.uuid for m in node.backend.inventory().gpus[H100].mig_devices] == [static.uuid]
    assert preparer.owned_mig_uuids() == frozenset()


async def test_admin_access_looks_at_a_created_mig_device_without_owning_it(node: Node) -> None:
    preparer = await node.started()
    workload, monitor, early = new_ref("workload"), new_ref("monitor"), new_ref("early")
    node.allocate(early, "gpu-1-mig-2g20gb-14-4", admin_access=True)
    node.allocate(workload, "gpu-1-mig-2g20gb-14-4")
    node.allocate(monitor, "gpu-1-mig-2g20gb-14-4", admin_access=True)

    assert "needs its MIG device to exist" in error_of((await preparer.prepare([early]))[early.uid])
    await preparer.prepare([workload])
    devices_of((await preparer.prepare([monitor]))[monitor.uid])
    assert node.on_disk().claims[monitor.uid].devices[0].mig is None
    assert await preparer.unprepare([monitor]) == {monitor.uid: None}

    assert live_migs(node, 1) == [("2g.20gb", 4)]  # the workload's device stays
    assert_nothing_left_for(node, early.uid)


# --- bad input: a clear per-claim error, and the GPU as it was -------------------------------------------


async def test_a_placement_overlapping_a_live_instance_fails_and_changes_nothing(node: Node) -> None:
    preparer = await node.started()
    first, stale = new_ref("first"), new_ref("stale")
    node.allocate(first, "gpu-0-mig-3g40gb-9-0")
    node.allocate(stale, "gpu-0-mig-1g10gb-19-1")  # slice 1 is inside the 3g instance
    await preparer.prepare([first])

    complaint = error_of((await preparer.prepare([stale]))[stale.uid])

    # The store refuses it before any NVML call: the 3g device holds memory slices 0..3.
    assert "device gpu-0-mig-1g10gb-19-1 overlaps MIG device gpu-0-mig-3g40gb-9-0" in complaint
    assert f"prepared for claim default/first ({first.uid})" in complaint
    assert "allocated it from a stale ResourceSlice" in complaint
    assert live_migs(node) == [("3g.40gb", 0)]
    assert_nothing_left_for(node, stale.uid)


async def test_a_failure_half_way_through_a_claim_destroys_what_it_created(node: Node) -> None:
    node.backend.admin_create_mig(1, "1g.10gb", 0)  # an administrator's, on slice 0 of gpu-1
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0", "gpu-1-mig-2g20gb-14-0")

    complaint = error_of((await preparer.prepare([ref]))[ref.uid])

    assert "cannot create MIG device gpu-1-mig-2g20gb-14-0" in complaint
    assert live_migs(node, 0) == []  # the first device of the claim is gone again
    assert not node.backend.inventory().gpus[H100].mig_enabled
    assert live_migs(node, 1) == [("1g.10gb", 0)]
    assert_nothing_left_for(node, ref.uid)


@pytest.mark.parametrize(
    ("device", "complaint"),
    [
        ("gpu-0-mig-3g40gb-9-2", "device gpu-0-mig-3g40gb-9-2 does not exist on this node"),  # 3g: 0 or 4
        ("gpu-4-mig-1g10gb-19-0", "device gpu-4-mig-1g10gb-19-0 does not exist on this node"),  # L4
        (
            "gpu-2-mig-3g20gb-9-0",
            "device gpu-2-mig-3g20gb-9-0 is a MIG placement on gpu-2 (NVIDIA A100-SXM4-40GB), but the "
            "driver does not create MIG devices there: its MIG mode is off and switching it on needs a "
            "GPU reset (Ampere)",
        ),
    ],
)
async def test_a_placement_the_gpu_does_not_offer_is_refused(node: Node, device: str, complaint: str) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, device)

    assert complaint in error_of((await preparer.prepare([ref]))[ref.uid])

    assert all(not gpu.mig_devices and not gpu.mig_enabled for gpu in node.backend.inventory().gpus)
    assert_nothing_left_for(node, ref.uid)


async def test_a_gpu_excluded_from_partitions_gets_no_mig_device(node: Node) -> None:
    preparer = await node.started(partition=partition_selected({"1"}))
    ref, allowed = new_ref("excluded"), new_ref("allowed")
    node.allocate(ref, "gpu-0-mig-1g10gb-19-0")
    node.allocate(allowed, "gpu-1-mig-1g10gb-19-0")

    outcomes = await preparer.prepare([ref, allowed])

    assert "MIG partitions are turned off for it (--mig-partitions)" in error_of(outcomes[ref.uid])
    devices_of(outcomes[allowed.uid])
    assert (live_migs(node, 0), live_migs(node, 1)) == ([], [("1g.10gb", 0)])


async def test_an_ampere_gpu_in_mig_mode_gets_mig_devices_and_stays_in_mig_mode(node: Node) -> None:
    node.backend.admin_set_mig_mode(A100, True)  # what an administrator does, with a GPU reset
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-2-mig-3g20gb-9-4")

    devices_of((await preparer.prepare([ref]))[ref.uid])
    assert live_migs(node, A100) == [("3g.20gb", 4)]
    await preparer.unprepare([ref])

    gpu = node.backend.inventory().gpus[A100]
    assert (gpu.mig_devices, gpu.mig_enabled) == ((), True)


async def test_a_full_gpu_with_a_live_mig_device_is_refused(node: Node) -> None:
    preparer = await node.started()
    partitioned, whole = new_ref("partitioned"), new_ref("whole")
    node.allocate(partitioned, "gpu-0-mig-1g10gb-19-3")
    node.allocate(whole, "gpu-0")
    await preparer.prepare([partitioned])

    assert "device gpu-0 is in MIG mode and cannot be used whole" in error_of(
        (await preparer.prepare([whole]))[whole.uid]
    )
    assert_nothing_left_for(node, whole.uid)


async def test_a_stale_view_cannot_put_a_full_gpu_and_a_mig_device_of_it_in_two_claims(node: Node) -> None:
    before = node.backend.inventory()
    # Plans against what the GPUs looked like at the start, as a slow inventory refresh would.
    preparer = await node.started(inventory=lambda: before)
    partitioned, whole, late = new_ref("partitioned"), new_ref("whole"), new_ref("late")
    node.allocate(partitioned, "gpu-0-mig-1g10gb-19-3")
    node.allocate(whole, "gpu-0")
    node.allocate(late, "gpu-1-mig-1g10gb-19-0")
    whole_gpu1 = new_ref("whole-gpu1")
    node.allocate(whole_gpu1, "gpu-1")

    await preparer.prepare([partitioned, whole_gpu1])
    refused_whole = error_of((await preparer.prepare([whole]))[whole.uid])
    refused_mig = error_of((await preparer.prepare([late]))[late.uid])

    assert "GPU gpu-0 cannot be prepared whole: claim default/partitioned" in refused_whole
    assert "holds a MIG device on it" in refused_whole
    assert "MIG device gpu-1-mig-1g10gb-19-0 cannot be created: its GPU gpu-1 is prepared whole for " in (
        refused_mig
    )
    assert live_migs(node, 1) == []
    assert_nothing_left_for(node, whole.uid)
    assert_nothing_left_for(node, late.uid)


async def test_two_claims_for_one_placement_exactly_one_wins(node: Node) -> None:
    preparer = await node.started()
    refs = [new_ref(f"racer-{i}") for i in range(4)]
    for ref in refs:
        node.allocate(ref, "gpu-1-mig-4g40gb-5-0")

    outcomes = await preparer.prepare(refs)

    winners = [uid for uid, outcome in outcomes.items() if isinstance(outcome, tuple)]
    assert len(winners) == 1
    assert live_migs(node, 1) == [("4g.40gb", 0)]
    assert preparer.owned_mig_uuids() == {recorded_mig(node, winners[0]).uuid}


# --- unprepare while in use ------------------------------------------------------------------------------


async def test_a_mig_device_in_use_keeps_its_claim_until_the_retry_succeeds(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-7g80gb-0-0")
    await preparer.prepare([ref])
    mig_uuid = recorded_mig(node, ref.uid).uuid or ""
    node.backend.set_busy(mig_uuid, True)  # a process still runs on it

    refused = error_of((await preparer.unprepare([ref]))[ref.uid])

    assert f"cannot destroy MIG device gpu-0-mig-7g80gb-0-0 ({mig_uuid}) yet" in refused
    assert "has processes attached" in refused
    assert "the kubelet retries" in refused
    assert node.specs.path_for(ref.uid).exists()
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert live_migs(node) == [("7g.80gb", 0)]

    node.backend.set_busy(mig_uuid, False)
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert live_migs(node) == []
    assert_nothing_left_for(node, ref.uid)


async def test_a_claim_with_one_device_in_use_records_which_devices_are_gone(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0", "gpu-1-mig-3g40gb-9-0")
    await preparer.prepare([ref])
    busy = recorded_mig(node, ref.uid, 1).uuid or ""
    node.backend.set_busy(busy, True)

    error_of((await preparer.unprepare([ref]))[ref.uid])

    record = node.on_disk().claims[ref.uid]
    assert (live_migs(node, 0), live_migs(node, 1)) == ([], [("3g.40gb", 0)])
    assert [d.mig.uuid if d.mig else None for d in record.devices] == [None, busy]
    assert record.phase == "PrepareStarted"  # a repeated prepare would create gpu-0's device again
    assert preparer.owned_mig_uuids() == {busy}


# --- side effects that fail after the device exists ------------------------------------------------------


async def test_a_failed_spec_write_destroys_the_created_device(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-2g20gb-14-4")

    def failing_write(claim_uid: str, spec: Any) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(preparer._specs, "write", failing_write)

    assert "No space left on device" in error_of((await preparer.prepare([ref]))[ref.uid])
    assert live_migs(node) == []
    assert_nothing_left_for(node, ref.uid)


@pytest.mark.parametrize("failing", ["the claim's record", "the table of MIG devices"])
async def test_a_failed_store_write_after_the_create_destroys_the_device(
    node: Node, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-1-mig-1g10gb-19-5")
    real_commit = Store.commit

    def failing_once_a_mig_uuid_is_in_it(store: Store, mutation: Any) -> None:
        if isinstance(mutation, Progress) and any(d.mig and d.mig.uuid for d in mutation.record.devices):
            raise StoreWriteError("cannot write the node's store: disk I/O error")
        real_commit(store, mutation)

    def failing_add(store: Store, mig: MigRecord) -> None:
        raise StoreWriteError("cannot write the node's store: disk I/O error")

    if failing == "the claim's record":
        monkeypatch.setattr(Store, "commit", failing_once_a_mig_uuid_is_in_it)
    else:
        monkeypatch.setattr(Store, "add_mig_device", failing_add)

    assert "disk I/O error" in error_of((await preparer.prepare([ref]))[ref.uid])
    assert live_migs(node, 1) == []
    assert_nothing_left_for(node, ref.uid)


# --- per-GPU serialization -------------------------------------------------------------------------------


class ObservedBackend(SimulatedBackend):
    """The simulator, watched: how many MIG operations run at once per GPU, and across GPUs."""

    def __init__(self, node: Node, rendezvous: threading.Barrier) -> None:
        super().__init__("mixed", NODE, node.root / "sim", boot_id_path=node.boot_id_path)
        self._rendezvous = rendezvous
        self._guard = threading.Lock()
        self._running: dict[str, int] = {}
        self.most_at_once: dict[str, int] = {}

    def create_mig_device(self, parent_uuid: str, profile_id: int, placement: Placement) -> MigDevice:
        with self._guard:
            self._running[parent_uuid] = self._running.get(parent_uuid, 0) + 1
            self.most_at_once[parent_uuid] = max(
                self.most_at_once.get(parent_uuid, 0), self._running[parent_uuid]
            )
        try:
            if placement.start == 0:
                # The first create on each of the two GPUs waits here for the other: this only
                # passes if creates on different GPUs run at the same time.
                self._rendezvous.wait()
            return super().create_mig_device(parent_uuid, profile_id, placement)
        finally:
            with self._guard:
                self._running[parent_uuid] -= 1


async def test_mig_operations_take_turns_per_gpu_and_run_in_parallel_across_gpus(node: Node) -> None:
    backend = ObservedBackend(node, threading.Barrier(2, timeout=30))
    preparer = await node.started(backend=backend)
    refs = [new_ref(f"c-{gpu}-{start}") for gpu in (0, 1) for start in range(4)]
    for ref in refs:
        _, gpu, start = ref.name.split("-")
        node.allocate(ref, f"gpu-{gpu}-mig-1g10gb-19-{start}")

    outcomes = await preparer.prepare(refs)

    assert all(isinstance(o, tuple) for o in outcomes.values()), outcomes
    assert backend.most_at_once == {gpu.uuid: 1 for gpu in node.backend.inventory().gpus[:2]}


# --- a restart repairs what a crash left ----------------------------------------------------------------


def crashed_record(
    ref: ClaimRef, device: str, mig: MigRecord | None, phase: Phase = "PrepareStarted"
) -> ClaimRecord:
    return ClaimRecord(
        namespace=ref.namespace,
        name=ref.name,
        phase=phase,
        attempt="crashed",
        devices=(
            DeviceRecord(
                request="gpu",
                pool=NODE,
                device=device,
                cdi_device_ids=(f"{KIND}={ref.uid}-{device}",),
                mig=mig,
            ),
        ),
    )


def intent(
    node: Node, gpu: int, profile_id: int, start: int, size: int, uuid: str | None = None
) -> MigRecord:
    return MigRecord(
        parent_uuid=node.backend.inventory().gpus[gpu].uuid,
        parent_device=f"gpu-{gpu}",
        profile_id=profile_id,
        placement_start=start,
        placement_size=size,
        uuid=uuid,
    )


async def test_a_device_created_just_before_a_crash_is_adopted_and_destroyed_by_unprepare(node: Node) -> None:
    # The crash came after the create and before its uuid was recorded.
    orphan = node.backend.create_mig_device(node.backend.inventory().gpus[H100].uuid, 9, Placement(4, 4))
    static = node.backend.admin_create_mig(H100, "1g.10gb", 0)  # an administrator's: not ours
    ref = new_ref()
    node.write_records({ref.uid: crashed_record(ref, "gpu-0-mig-3g40gb-9-4", intent(node, H100, 9, 4, 4))})

    preparer = await node.started()

    assert recorded_mig(node, ref.uid).uuid == orphan.uuid
    assert preparer.owned_mig_uuids() == {orphan.uuid}
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert [m.uuid for m in node.backend.inventory().gpus[H100].mig_devices] == [static.uuid]


async def test_an_adopted_device_serves_the_kubelets_next_prepare(node: Node) -> None:
    orphan = node.backend.create_mig_device(node.backend.inventory().gpus[1].uuid, 14, Placement(2, 2))
    ref = new_ref()
    node.write_records({ref.uid: crashed_record(ref, "gpu-1-mig-2g20gb-14-2", intent(node, 1, 14, 2, 2))})
    node.allocate(ref, "gpu-1-mig-2g20gb-14-2")

    preparer = await node.started()
    devices_of((await preparer.prepare([ref]))[ref.uid])

    assert [m.uuid for m in node.backend.inventory().gpus[1].mig_devices] == [orphan.uuid]
    assert node.on_disk().claims[ref.uid].phase == "PrepareCompleted"
    assert preparer.owned_mig_uuids() == {orphan.uuid}  # so its unprepare destroys it


async def test_a_crash_before_the_create_leaves_a_placement_the_next_prepare_creates(node: Node) -> None:
    ref = new_ref()
    node.write_records({ref.uid: crashed_record(ref, "gpu-0-mig-1g10gb-19-6", intent(node, H100, 19, 6, 1))})
    node.allocate(ref, "gpu-0-mig-1g10gb-19-6")

    preparer = await node.started()
    assert recorded_mig(node, ref.uid).uuid is None
    devices_of((await preparer.prepare([ref]))[ref.uid])

    assert live_migs(node) == [("1g.10gb", 6)]


async def test_a_recorded_device_that_is_gone_sends_its_claim_back_to_prepare(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-4g40gb-5-0")
    await preparer.prepare([ref])
    gone = recorded_mig(node, ref.uid).uuid or ""
    node.backend.destroy_mig_device(node.backend.inventory().gpus[H100].uuid, gone)  # an administrator

    restarted = await node.started()

    record = node.on_disk().claims[ref.uid]
    assert (record.phase, recorded_mig(node, ref.uid).uuid) == ("PrepareStarted", None)
    assert not node.specs.path_for(ref.uid).exists()  # it named a device that is gone
    devices_of((await restarted.prepare([ref]))[ref.uid])  # the kubelet's next prepare
    assert live_migs(node) == [("4g.40gb", 0)]
    assert recorded_mig(node, ref.uid).uuid not in (None, gone)


async def test_a_reboot_forgets_every_mig_device(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0")
    await (await node.started()).prepare([ref])

    node.reboot()
    preparer = await node.started()

    assert node.on_disk().claims == {}
    assert live_migs(node) == []
    assert preparer.owned_mig_uuids() == frozenset()


def lose_record(node: Node, uid: str) -> None:
    """The claim's record is lost while the store (and its table of MIG devices) survives."""
    store = open_store(node.store_path, node.boot_id_path.read_text().strip()).store
    store._db.execute("DELETE FROM holds WHERE uid = ?", (uid,))
    store._db.execute("DELETE FROM claims WHERE uid = ?", (uid,))
    store.close()


async def test_after_a_lost_record_the_drivers_devices_are_still_its_own(node: Node) -> None:
    ref, whole = new_ref(), new_ref("whole")
    node.allocate(ref, "gpu-1-mig-3g40gb-9-4")
    await (await node.started()).prepare([ref])
    static = node.backend.admin_create_mig(1, "1g.10gb", 0)  # an administrator's, beside it
    lose_record(node, ref.uid)

    preparer = await node.started()

    # The rebuilt record still knows the MIG device, so the full GPU is not given out under it
    # (the store's index refuses it even where the GPU's MIG mode would not)...
    recovered = recorded_mig(node, ref.uid)
    assert (recovered.parent_device, recovered.profile_id, recovered.placement_start) == ("gpu-1", 9, 4)
    assert preparer.owned_mig_uuids() == {recovered.uuid}
    with pytest.raises(MutationRejected, match="cannot be prepared whole: claim"):
        preparer._state().commit(Reserve(whole.uid, crashed_record(whole, "gpu-1", None)))
    # ...and the claim's unprepare destroys it, while the administrator's stays.
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert node.on_disk().claims == {}
    assert [m.uuid for m in node.backend.inventory().gpus[1].mig_devices] == [static.uuid]


async def test_after_a_lost_store_a_recovered_mig_claim_keeps_its_gpu_and_its_unprepare_destroys_the_device(
    node: Node,
) -> None:
    ref, whole = new_ref(), new_ref("whole")
    node.allocate(ref, "gpu-1-mig-3g40gb-9-4")
    await (await node.started()).prepare([ref])
    for path in node.state_dir.glob("state.db*"):
        path.unlink()  # the data directory is wiped: the table of MIG devices goes with it

    preparer = await node.started()

    # (the plan refuses the GPU while it is in MIG mode; the store refuses it even where it would not)
    with pytest.raises(MutationRejected, match=f"cannot be prepared whole: claim {ref.uid}"):
        preparer._state().commit(Reserve(whole.uid, crashed_record(whole, "gpu-1", None)))
    # The spec says the driver made the device for the claim: the claim's unprepare destroys it.
    assert await preparer.unprepare([ref]) == {ref.uid: None}
    assert node.backend.inventory().gpus[1].mig_devices == ()


async def test_a_device_the_table_lost_track_of_is_entered_again(node: Node) -> None:
    ref = new_ref()
    node.allocate(ref, "gpu-0-mig-3g40gb-9-0")
    await (await node.started()).prepare([ref])
    mig_uuid = recorded_mig(node, ref.uid).uuid
    store = open_store(node.store_path, node.boot_id_path.read_text().strip()).store
    store.remove_mig_device(mig_uuid or "")  # a crash between the create and its entry
    store.close()

    await node.started()
    lose_record(node, ref.uid)  # and then the claim's record is lost, too
    preparer = await node.started()

    assert preparer.owned_mig_uuids() == {mig_uuid}


async def test_leftover_temporary_spec_files_are_removed_at_start(node: Node) -> None:
    """A temporary spec file nobody holds locked is a dead write's, however young: a crash and a
    quick restart must not leave it. One a live writer holds (the other plugin instance of a rolling
    update, writing right now) stays."""
    node.cdi_dir.mkdir(parents=True, exist_ok=True)
    prefix = f".{KIND.replace('/', '-')}_"
    old, young = node.cdi_dir / f"{prefix}u-old.ab12.tmp", node.cdi_dir / f"{prefix}u-young.cd34.tmp"
    in_progress = node.cdi_dir / f"{prefix}u-busy.ef56.tmp"
    for leftover in (old, young, in_progress):
        leftover.write_text("{half")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))

    with in_progress.open() as writer:
        fcntl.flock(writer, fcntl.LOCK_EX)
        await node.started()

    assert not old.exists()
    assert not young.exists()
    assert in_progress.exists()


async def test_many_claims_on_many_gpus_of_a_16_gpu_node(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("boot-1\n")
    backend = SimulatedBackend("hgx-h100-16", NODE, tmp_path / "sim", boot_id_path=tmp_path / "boot_id")
    big = Node(tmp_path, backend, InMemoryClaims(), RecordingObserver())
    preparer: NodePreparer = await big.started()
    refs = [new_ref(f"c{gpu}") for gpu in range(16)]
    for gpu, ref in enumerate(refs):
        big.allocate(ref, f"gpu-{gpu}-mig-1g10gb-19-{gpu % 7}")

    outcomes = await asyncio.wait_for(preparer.prepare(refs), timeout=60)

    assert all(isinstance(o, tuple) for o in outcomes.values()), outcomes
    inventory = backend.inventory()
    assert [[m.placement.start for m in gpu.mig_devices] for gpu in inventory.gpus] == [
        [gpu % 7] for gpu in range(16)
    ]


async def test_during_a_rolling_update_the_new_instance_destroys_what_the_old_one_created(node: Node) -> None:
    # Both plugin instances run; the new one started before the old one prepared.
    old = await node.started()
    new = await node.started()
    ref = new_ref("rolling")
    node.allocate(ref, "gpu-0-mig-3g40gb-9-4")
    assert isinstance((await old.prepare([ref]))[ref.uid], tuple)
    assert [m.profile for m in node.backend.inventory().gpus[0].mig_devices] == ["3g.40gb"]

    assert await new.unprepare([ref]) == {ref.uid: None}
    assert node.backend.inventory().gpus[0].mig_devices == ()  # no orphan instance
    assert ref.uid not in node.on_disk().claims
