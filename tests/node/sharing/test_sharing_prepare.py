"""Sharing applied on the GPU: time-slicing sets compute mode and time slice, MPS runs a daemon.

Every test checks the GPU's state as the backend reports it (what ``nvidia-smi -q`` would show),
the daemon as a process, and what the container gets from the CDI spec. The simulated node has two
H100s (gpu-0, gpu-1), two A100-40GBs (gpu-2, gpu-3) and two L4s (gpu-4, gpu-5).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

import pytest

from dra_driver.devices.types import ComputeMode, ComputePolicy, Inventory, TimeSlice
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError, ClaimRef, PreparedDevice

from ..builders import Node, gpu_config, new_ref, opaque

DEFAULT = ComputePolicy()
NVIDIA = "resource.nvidia.com/v1beta1"


def devices_of(outcome: object) -> tuple[PreparedDevice, ...]:
    assert isinstance(outcome, tuple), outcome
    return outcome


def error_of(outcome: object) -> str:
    assert isinstance(outcome, ClaimError), outcome
    return outcome.message


def policy(node: Node, gpu: int) -> ComputePolicy:
    return node.backend.compute_policy(node.backend.inventory().gpus[gpu].uuid)


def uuid_of(node: Node, gpu: int) -> str:
    return node.backend.inventory().gpus[gpu].uuid


def claim_env(node: Node, uid: str) -> dict[str, str]:
    spec = json.loads(node.specs.path_for(uid).read_text())
    return dict(entry.split("=", 1) for entry in spec["containerEdits"]["env"])


def claim_mounts(node: Node, uid: str) -> dict[str, dict[str, Any]]:
    spec = json.loads(node.specs.path_for(uid).read_text())
    return {m["containerPath"]: m for m in spec["containerEdits"].get("mounts", [])}


def time_sliced(interval: str, source: str = "FromClaim") -> dict[str, Any]:
    return opaque(
        gpu_config({"strategy": "TimeSlicing", "timeSlicing": {"interval": interval}}), source=source
    )


def mps(**settings: Any) -> dict[str, Any]:
    return opaque(gpu_config({"strategy": "MPS", "mps": settings}))


async def prepared(preparer: NodePreparer, ref: ClaimRef) -> tuple[PreparedDevice, ...]:
    return devices_of((await preparer.prepare([ref]))[ref.uid])


def assert_nothing_left_for(node: Node, uid: str) -> None:
    assert not node.specs.path_for(uid).exists()
    assert uid not in node.on_disk().claims
    assert not list(node.mps.paths("x").root.parent.glob(f"{uid}-*"))


# --- time-slicing ---------------------------------------------------------------------------------------


async def test_time_slicing_sets_the_interval_and_unprepare_puts_back_what_was_there(node: Node) -> None:
    node.backend.set_compute_policy(uuid_of(node, 0), ComputePolicy(time_slice=TimeSlice.MEDIUM))
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[time_sliced("Long")])

    await prepared(preparer, ref)
    assert policy(node, 0) == ComputePolicy(ComputeMode.DEFAULT, TimeSlice.LONG)
    assert policy(node, 1) == DEFAULT  # only the allocated GPU changes

    assert (await preparer.unprepare([ref]))[ref.uid] is None
    assert policy(node, 0) == ComputePolicy(time_slice=TimeSlice.MEDIUM)


async def test_a_plugin_that_died_after_changing_the_gpu_restores_it_at_unprepare(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[time_sliced("Short")])

    async def died(self: NodePreparer, *args: object) -> None:  # the process ended before any undo
        return None

    def failing_write(*args: object) -> None:
        raise OSError(5, "EIO")

    monkeypatch.setattr(NodePreparer, "_undo", died)
    monkeypatch.setattr(type(node.specs), "write", failing_write)
    assert "EIO" in error_of((await preparer.prepare([ref]))[ref.uid])
    assert policy(node, 0).time_slice is TimeSlice.SHORT  # changed, and nobody undid it
    assert node.on_disk().claims[ref.uid].phase == "PrepareStarted"
    monkeypatch.undo()

    restarted = await node.started()
    assert (await restarted.unprepare([ref]))[ref.uid] is None
    assert policy(node, 0) == DEFAULT
    assert_nothing_left_for(node, ref.uid)


SHARE = {"memory": "10Gi"}  # what the scheduler records for a share of a shareable GPU


async def test_two_claims_on_one_gpu_must_agree_on_the_interval(node: Node) -> None:
    # Two claims on one GPU: shares of it, from two classes whose configs time-slice differently
    # (a share's strategy is its class's, shares.py).
    preparer = await node.started(consumable=True)
    first, second, third = new_ref("first"), new_ref("second"), new_ref("third")
    node.allocate(
        first,
        "gpu-0",
        configs=[time_sliced("Short", "FromClass")],
        share_id="11111111-0000-0000-0000-000000000001",
        consumed=SHARE,
    )
    node.allocate(
        second,
        "gpu-0",
        configs=[time_sliced("Long", "FromClass")],
        share_id="11111111-0000-0000-0000-000000000002",
        consumed=SHARE,
    )
    node.allocate(
        third,
        "gpu-0",
        configs=[time_sliced("Short", "FromClass")],
        share_id="11111111-0000-0000-0000-000000000003",
        consumed=SHARE,
    )
    await prepared(preparer, first)

    error = error_of((await preparer.prepare([second]))[second.uid])
    assert error == (
        "device gpu-0: its GPU is already set to TimeSlicing with interval Short for claim "
        f"default/first ({first.uid}), and this claim asks for TimeSlicing with interval Long; claims "
        "sharing one GPU must agree on its settings (there is one compute mode and one time slice per GPU)"
    )
    assert policy(node, 0).time_slice is TimeSlice.SHORT
    assert_nothing_left_for(node, second.uid)

    await prepared(preparer, third)  # the same interval is fine
    assert (await preparer.unprepare([first]))[first.uid] is None
    assert policy(node, 0).time_slice is TimeSlice.SHORT  # the third claim still time-slices it
    assert (await preparer.unprepare([third]))[third.uid] is None
    assert policy(node, 0) == DEFAULT  # the last one out restores


async def test_time_slicing_on_a_mig_device_changes_nothing_and_its_interval_is_refused(node: Node) -> None:
    preparer = await node.started()
    mig = "gpu-0-mig-1g10gb-19-0"
    fixed = new_ref("fixed")
    node.allocate(
        fixed,
        mig,
        configs=[
            opaque({"apiVersion": NVIDIA, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}})
        ],
    )
    await prepared(preparer, fixed)
    assert policy(node, 0) == DEFAULT

    ours, theirs = new_ref("ours"), new_ref("theirs")
    long_slices = {"strategy": "TimeSlicing", "timeSlicing": {"interval": "Long"}}
    node.allocate(ours, "gpu-1-mig-1g10gb-19-0", configs=[opaque(gpu_config(long_slices), requests=["gpu"])])
    interval = {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}
    node.allocate(
        theirs,
        "gpu-1-mig-1g10gb-19-0",
        configs=[opaque({"apiVersion": NVIDIA, "kind": "MigDeviceConfig", "sharing": interval})],
    )
    for ref in (ours, theirs):
        error = error_of((await preparer.prepare([ref]))[ref.uid])
        assert "MIG" in error, error
        assert_nothing_left_for(node, ref.uid)
    assert policy(node, 1) == DEFAULT
    assert node.backend.inventory().gpus[1].mig_devices == ()  # no MIG device was created for them


# --- MPS ------------------------------------------------------------------------------------------------


async def test_mps_runs_a_daemon_per_claim_in_exclusive_process_mode(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(
        ref,
        "gpu-0",
        "gpu-1",
        configs=[mps(defaultActiveThreadPercentage=25, defaultPinnedDeviceMemoryLimit="10Gi")],
    )

    await prepared(preparer, ref)
    for gpu in (0, 1):
        assert policy(node, gpu) == ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS)
    daemon = node.on_disk().claims[ref.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    assert daemon.startswith(f"{ref.uid}-")
    assert node.mps.pid(daemon) is not None
    paths = node.mps.paths(daemon)
    env = claim_env(node, ref.uid)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{uuid_of(node, 0)}=10240M,{uuid_of(node, 1)}=10240M"
    mounts = claim_mounts(node, ref.uid)
    assert mounts["/tmp/nvidia-mps"]["hostPath"] == str(paths.pipe)
    assert mounts["/dev/shm"]["hostPath"] == str(paths.shm)
    assert "/var/log/nvidia-mps" not in mounts  # the daemon's log: written by it, not by clients
    assert "CUDA_MPS_LOG_DIRECTORY" not in env

    assert (await preparer.unprepare([ref]))[ref.uid] is None
    assert node.mps.pid(daemon) is None
    assert not paths.root.exists()
    assert policy(node, 0) == DEFAULT
    assert policy(node, 1) == DEFAULT


async def test_a_daemon_that_fails_fails_the_prepare_and_leaves_the_gpu_as_it_was(node: Node) -> None:
    node.backend.set_mps_broken(0, True)
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[mps()])

    error = error_of((await preparer.prepare([ref]))[ref.uid])
    assert error.startswith(f"MPS control daemon {ref.uid}-")
    assert "exited before it was ready" in error
    assert "could not create its context" in error
    assert policy(node, 0) == DEFAULT
    assert_nothing_left_for(node, ref.uid)

    node.backend.set_mps_broken(0, False)  # repaired: the kubelet's retry succeeds
    await prepared(preparer, ref)
    assert policy(node, 0).compute_mode is ComputeMode.EXCLUSIVE_PROCESS


async def test_mps_on_a_mig_device_serves_the_new_device_and_leaves_its_gpu_alone(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(
        ref,
        "gpu-0-mig-3g40gb-9-0",
        configs=[opaque({"apiVersion": NVIDIA, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}})],
    )
    await prepared(preparer, ref)
    (mig,) = node.backend.inventory().gpus[0].mig_devices
    daemon = node.on_disk().claims[ref.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    assert f"for {mig.uuid}" in (node.mps.paths(daemon).log / "control.log").read_text()
    assert policy(node, 0) == DEFAULT

    assert (await preparer.unprepare([ref]))[ref.uid] is None
    assert node.backend.inventory().gpus[0].mig_devices == ()
    assert node.mps.pid(daemon) is None


# --- bad input: a clear error, nothing changed ----------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (
            mps(defaultActiveThreadPercentage=101),
            "sharing.mps.defaultActiveThreadPercentage: Input should be less than or equal to 100",
        ),
        (
            mps(defaultActiveThreadPercentage=0),
            "sharing.mps.defaultActiveThreadPercentage: Input should be greater than or equal to 1",
        ),
        (mps(defaultPinnedDeviceMemoryLimit="100Gi"), "100Gi exceeds the device's memory (81559 MiB)"),
    ],
)
async def test_limits_the_device_cannot_have_are_refused(
    node: Node, config: dict[str, Any], expected: str
) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[config])
    error = error_of((await preparer.prepare([ref]))[ref.uid])
    assert expected in error, error
    assert policy(node, 0) == DEFAULT
    assert_nothing_left_for(node, ref.uid)


async def test_mps_on_a_gpu_older_than_volta_is_refused(node: Node) -> None:
    real = node.backend.inventory()
    pascal = dataclasses.replace(real.gpus[4], cuda_compute_capability=(6, 1), product_name="Tesla P4")
    inventory = dataclasses.replace(real, gpus=(*real.gpus[:4], pascal, real.gpus[5]))

    def current() -> Inventory:
        return inventory

    preparer = await node.started(inventory=current)
    ref = new_ref()
    node.allocate(ref, "gpu-4", configs=[mps()])
    assert error_of((await preparer.prepare([ref]))[ref.uid]) == (
        "device gpu-4 (Tesla P4, compute capability 6.1) cannot run MPS with client limits, which needs "
        "Volta or newer (7.0); use TimeSlicing"
    )
    assert policy(node, 4) == DEFAULT
    assert_nothing_left_for(node, ref.uid)


async def test_a_gpu_an_administrator_prohibited_is_refused(node: Node) -> None:
    node.backend.set_compute_policy(uuid_of(node, 0), ComputePolicy(ComputeMode.PROHIBITED))
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[mps()])
    assert "compute mode Prohibited" in error_of((await preparer.prepare([ref]))[ref.uid])
    assert policy(node, 0) == ComputePolicy(ComputeMode.PROHIBITED)
    assert_nothing_left_for(node, ref.uid)


async def test_an_exclusive_claim_changes_nothing(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0")
    await prepared(preparer, ref)
    assert policy(node, 0) == DEFAULT
    assert node.on_disk().claims[ref.uid].sharing is None
    assert "CUDA_MPS_PIPE_DIRECTORY" not in claim_env(node, ref.uid)


# --- restarts and lost state ----------------------------------------------------------------------------


async def test_a_daemon_no_claim_records_is_stopped_when_the_plugin_starts(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[mps()])
    await prepared(preparer, ref)
    stray = node.mps.paths("0badc0de-0000-0000-0000-000000000000-abcde").root
    stray.mkdir(parents=True)  # e.g. a prepare that crashed before its record was written

    await node.started()

    assert not stray.exists()
    daemon = node.on_disk().claims[ref.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    assert node.mps.pid(daemon) is not None  # the recorded one keeps serving its claim


async def test_a_daemon_the_other_instance_starts_meanwhile_is_left_running(node: Node) -> None:
    # A rolling update: the old instance prepares an MPS claim after the new one has read the
    # checkpoint and before it lists the daemons. That daemon is the old instance's, not a crash's.
    old = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[mps()])
    new = node.preparer()
    daemons = new._sharing._mps
    assert daemons is not None
    real_running = daemons.running

    async def running_after_the_old_instance_prepared() -> set[str]:
        await prepared(old, ref)
        return await real_running()

    daemons.running = running_after_the_old_instance_prepared  # type: ignore[method-assign]
    await new.start()

    daemon = node.on_disk().claims[ref.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    assert node.mps.pid(daemon) is not None
    assert (await new.unprepare([ref]))[ref.uid] is None
    assert_nothing_left_for(node, ref.uid)


async def test_a_lost_store_still_stops_the_claims_daemon_at_unprepare(node: Node) -> None:
    preparer = await node.started()
    ref = new_ref()
    node.allocate(ref, "gpu-0", configs=[mps()])
    await prepared(preparer, ref)
    daemon = node.on_disk().claims[ref.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    for path in node.state_dir.glob("state.db*"):
        path.unlink()  # the node's disk lost the store; the CDI spec survives

    restarted = await node.started()
    assert node.on_disk().claims[ref.uid].phase == "Recovered"
    assert node.mps.pid(daemon) is not None  # its claim may still be running
    assert (await restarted.unprepare([ref]))[ref.uid] is None
    assert node.mps.pid(daemon) is None
    assert not node.mps.paths(daemon).root.exists()


async def two_shares_after_a_lost_store(node: Node) -> tuple[NodePreparer, ClaimRef, ClaimRef, str]:
    """Two shares of gpu-1 prepared, the store lost (their CDI specs survive), the plugin restarted:
    the restarted preparer, the two claims, and their GPU's shared daemon, still running."""
    preparer = await node.started(consumable=True)
    first, second = new_ref("first"), new_ref("second")
    for ref in (first, second):
        node.allocate(ref, "gpu-1", share_id=str(uuid.uuid4()), consumed={"memory": "20Gi"})
    await preparer.prepare([first, second])
    daemon = node.on_disk().claims[first.uid].sharing.mps_daemon  # type: ignore[union-attr]
    assert daemon is not None
    assert daemon.startswith("shared-")
    for path in node.state_dir.glob("state.db*"):
        path.unlink()
    restarted = await node.started(consumable=True)
    assert {record.phase for record in node.on_disk().claims.values()} == {"Recovered"}
    assert node.mps.pid(daemon) is not None  # both shares' containers may still be its clients
    return restarted, first, second, daemon


async def test_a_gpus_shared_daemon_outlives_a_lost_store_until_its_last_share_is_unprepared(
    node: Node,
) -> None:
    restarted, first, second, daemon = await two_shares_after_a_lost_store(node)
    assert (await restarted.unprepare([first]))[first.uid] is None
    assert node.mps.pid(daemon) is not None  # the second share's still may
    assert (await restarted.unprepare([second]))[second.uid] is None
    assert node.mps.pid(daemon) is None
    assert not node.mps.paths(daemon).root.exists()


async def test_after_a_lost_store_a_pod_of_two_shares_unprepared_together_stops_their_shared_daemon(
    node: Node,
) -> None:
    # Found by the kill -9 suite: one call unprepares both claims of the pod, each saw the other
    # before its release, and neither stopped the daemon they were the last clients of.
    restarted, first, second, daemon = await two_shares_after_a_lost_store(node)
    assert (await restarted.unprepare([first, second])) == {first.uid: None, second.uid: None}
    assert node.mps.pid(daemon) is None
    assert not node.mps.paths(daemon).root.exists()
