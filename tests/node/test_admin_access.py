"""Admin access on a node: a maintenance claim gets a device a workload holds, says so to its container,
and comes and goes without touching the workload's claim."""

from __future__ import annotations

import json

from dra_driver.node.types import ClaimError

from .builders import Node, new_ref


def spec_env(node: Node, uid: str) -> dict[str, list[str]]:
    """The env of every device in the claim's CDI spec, by CDI device name."""
    spec = json.loads(node.specs.path_for(uid).read_text())
    return {device["name"]: device["containerEdits"].get("env", []) for device in spec["devices"]}


async def test_the_maintenance_container_is_told_it_has_admin_access_and_the_workload_is_not(
    node: Node,
) -> None:
    preparer = await node.started()
    workload, maintenance = new_ref("workload"), new_ref("diagnostics")
    node.allocate(workload, "gpu-2")
    node.allocate(maintenance, "gpu-2", admin_access=True)
    await preparer.prepare([workload])
    outcome = (await preparer.prepare([maintenance]))[maintenance.uid]
    assert not isinstance(outcome, ClaimError), outcome

    uuid = node.backend.inventory().gpus[2].uuid
    admin_env = spec_env(node, maintenance.uid)[f"{maintenance.uid}-gpu-2"]
    assert "DRA_GPU_ADMIN_ACCESS_GPU_2=true" in admin_env
    assert f"DRA_GPU_UUID_GPU_2={uuid}" in admin_env  # the same GPU the workload has
    assert not any("ADMIN_ACCESS" in env for env in spec_env(node, workload.uid)[f"{workload.uid}-gpu-2"])


async def test_unpreparing_the_maintenance_claim_leaves_the_workloads_claim_untouched(node: Node) -> None:
    preparer = await node.started()
    workload, maintenance = new_ref("workload"), new_ref("diagnostics")
    node.allocate(workload, "gpu-0-mig-1g10gb-19-2")
    await preparer.prepare([workload])
    node.allocate(maintenance, "gpu-0-mig-1g10gb-19-2", admin_access=True)
    await preparer.prepare([maintenance])
    workload_record = node.on_disk().claims[workload.uid]
    workload_spec = node.specs.path_for(workload.uid).read_text()

    assert (await preparer.unprepare([maintenance]))[maintenance.uid] is None

    assert node.on_disk().claims[workload.uid] == workload_record
    assert node.specs.path_for(workload.uid).read_text() == workload_spec
    (gpu,) = [g for g in node.backend.inventory().gpus if g.minor == 0]
    assert [m.uuid for m in gpu.mig_devices] == [workload_record.devices[0].mig.uuid]  # type: ignore[union-attr]


async def test_admin_access_to_a_mig_device_that_is_gone_fails_that_claim_with_what_to_do(node: Node) -> None:
    preparer = await node.started()
    workload, maintenance, other = new_ref("workload"), new_ref("diagnostics"), new_ref("other")
    node.allocate(workload, "gpu-0-mig-1g10gb-19-2")
    await preparer.prepare([workload])
    await preparer.unprepare([workload])  # the workload ended: its MIG device is destroyed
    node.allocate(maintenance, "gpu-0-mig-1g10gb-19-2", admin_access=True)
    node.allocate(other, "gpu-1")

    outcomes = await preparer.prepare([maintenance, other])

    error = outcomes[maintenance.uid]
    assert isinstance(error, ClaimError)
    assert "admin access to a MIG placement needs its MIG device to exist" in error.message
    assert not isinstance(outcomes[other.uid], ClaimError)  # the other claim of the call is prepared
    assert maintenance.uid not in node.on_disk().claims
    assert not node.specs.path_for(maintenance.uid).exists()
