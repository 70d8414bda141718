"""The fault suite's own judgement (e2e/reliability): what counts as a device held twice, a missed goal,
and the kill -9 runs' plans."""

from __future__ import annotations

import random

from dra_driver.node.records import ClaimRecord, DeviceRecord, MigRecord, PassthroughRecord
from dra_driver.node.types import ClaimRef
from e2e.reliability import kill9
from e2e.reliability.plugin import NodeState
from e2e.reliability.suite import missed_goals

ADDRESSES = {"gpu-3": "0000:5d:00.0", "gpu-4": "0000:9b:00.0"}  # the simulated DGX H100's


def record(*devices: DeviceRecord) -> ClaimRecord:
    return ClaimRecord(namespace="ns", name="c", phase="PrepareCompleted", attempt="a", devices=devices)


def device(
    name: str,
    *,
    admin: bool = False,
    mig_on: str | None = None,
    uuid: str | None = None,
    start: int = 0,
    share_id: str | None = None,
) -> DeviceRecord:
    mig = (
        MigRecord(
            parent_uuid="GPU-x",
            parent_device=mig_on,
            profile_id=19,
            placement_start=start,
            placement_size=1,
            uuid=uuid,
        )
        if mig_on
        else None
    )
    return DeviceRecord(
        request="r",
        pool="p",
        device=name,
        admin_access=admin,
        share_id=share_id,
        cdi_device_ids=("k=x",),
        mig=mig,
        passthrough=_passthrough(name),
    )


def _passthrough(name: str) -> PassthroughRecord | None:
    """The record of ``gpu-vfio-<index>``: on the simulated DGX H100 the GPU of the same index."""
    if "-vfio-" not in name:
        return None
    gpu = name.replace("-vfio-", "-")
    return PassthroughRecord(parent_device=gpu, pci_bus_id=ADDRESSES.get(gpu, "0000:00:00.0"))


def state(**records: ClaimRecord) -> NodeState:
    return NodeState(specs=frozenset(), records=records, mig_devices=(), temp_files=())


def test_one_device_in_two_records_is_a_double_allocation() -> None:
    found = state(a=record(device("gpu-1")), b=record(device("gpu-1"))).double_allocations()
    assert found == [f"gpu-1 slice {index}: ['a', 'b']" for index in range(8)]


def test_a_full_gpu_and_a_mig_device_on_it_for_two_claims_is_a_double_allocation() -> None:
    found = state(
        a=record(device("gpu-2")), b=record(device("gpu-2-mig-1g10gb-19-3", mig_on="gpu-2", start=3))
    ).double_allocations()
    assert found == ["gpu-2 slice 3: ['a', 'b']"]


def test_a_static_mig_device_overlapping_a_created_one_is_a_double_allocation() -> None:
    """The administrator's 3g.40gb at slices 0..3 (no MIG record: its name tells its placement)."""
    found = state(
        a=record(device("gpu-0-mig-3g40gb-9-0")),
        b=record(device("gpu-0-mig-1g10gb-19-2", mig_on="gpu-0", start=2)),
        c=record(device("gpu-0-mig-1g10gb-19-4", mig_on="gpu-0", start=4)),
    ).double_allocations()
    assert found == ["gpu-0 slice 2: ['a', 'b']"]


def test_one_mig_uuid_recorded_for_two_claims_is_a_double_allocation() -> None:
    a = record(device("gpu-3-mig-1g10gb-19-1", mig_on="gpu-3", uuid="MIG-1", start=1))
    b = record(device("gpu-3-mig-1g10gb-19-2", mig_on="gpu-3", uuid="MIG-1", start=2))
    assert state(a=a, b=b).double_allocations() == ["MIG-1: ['a', 'b']"]


def test_a_share_of_a_gpu_another_claim_holds_whole_or_in_part_is_a_double_allocation() -> None:
    share = device("gpu-5", share_id="0b7c6d4e-0000-4000-8000-000000000001")
    assert state(a=record(device("gpu-5")), b=record(share)).double_allocations() == [
        "gpu-5 shared by ['b'] and held by ['a']"
    ]
    mig = device("gpu-5-mig-1g10gb-19-6", mig_on="gpu-5", start=6)
    assert state(a=record(mig), b=record(share)).double_allocations() == [
        "gpu-5 shared by ['b'] and held by ['a']"
    ]


def test_a_gpu_passed_through_and_held_by_another_claim_whole_in_part_or_shared_is_a_double_allocation() -> (
    None
):
    vfio = record(device("gpu-vfio-3"))
    assert state(a=vfio, b=record(device("gpu-3"))).double_allocations() == [
        f"gpu-3 slice {index}: ['a', 'b']" for index in range(8)
    ]
    mig = device("gpu-3-mig-1g10gb-19-6", mig_on="gpu-3", start=6)
    assert state(a=vfio, b=record(mig)).double_allocations() == ["gpu-3 slice 6: ['a', 'b']"]
    share = device("gpu-3", share_id="0b7c6d4e-0000-4000-8000-000000000001")
    assert state(a=vfio, b=record(share)).double_allocations() == ["gpu-3 shared by ['b'] and held by ['a']"]
    assert not state(a=vfio, b=record(device("gpu-vfio-4")), c=record(device("gpu-5"))).double_allocations()


def bindings(
    off_nvidia: dict[str, str | None], kinds: dict[str, str], told: set[str], kept: set[str] = frozenset()
) -> list[str]:
    """What the kill -9 check says of a node whose GPUs at ``off_nvidia`` are bound there, and whose
    claims (by uid: their device) were all prepared, ``told`` of them told so to the kubelet."""
    plan = kill9.Plan(
        claims=tuple(kill9.ClaimPlan("passthrough" if "vfio" in d else "gpu", d) for d in kinds.values()),
        crash_point=None,
        external_kill=None,
        pod_deleted_after_kill=False,
    )
    refs = [ClaimRef(namespace="ns", name=uid, uid=uid) for uid in kinds]
    node = NodeState(
        specs=frozenset(),
        records={uid: record(device(name)) for uid, name in kinds.items()},
        mig_devices=(),
        temp_files=(),
        off_nvidia=off_nvidia,
    )
    return kill9._wrong_bindings(node, plan, refs, told, kill9._Kept(vfio=set(kept)))


def test_a_gpu_is_on_vfio_pci_exactly_while_a_passthrough_claim_holds_it() -> None:
    gpu3, gpu4 = ADDRESSES["gpu-3"], ADDRESSES["gpu-4"]
    claims = {"a": "gpu-vfio-3", "b": "gpu-4"}
    assert not bindings({gpu3: "vfio-pci"}, claims, told={"a", "b"})
    assert bindings({gpu3: "vfio-pci", gpu4: "vfio-pci"}, claims, told={"a", "b"}) == [
        f"GPU {gpu4} is bound to vfio-pci but no passthrough claim holds it"
    ]
    assert bindings({}, claims, told={"a"}) == [
        f"GPU {gpu3} is held by passthrough claims ['a'] but bound to nvidia"
    ]
    assert bindings({gpu3: None}, claims, told={"a"}) == [
        f"GPU {gpu3} is held by passthrough claims ['a'] but bound to None"
    ]
    # A prepare not finished yet (not told to the kubelet) may be before its bind; a lost store's GPU
    # that nothing names is left on vfio-pci (docs/passthrough.md).
    assert not bindings({}, claims, told={"b"})
    assert not bindings({gpu4: "vfio-pci"}, {"b": "gpu-4"}, told={"b"}, kept={gpu4})


def test_mig_devices_of_one_gpu_shares_admin_access_and_one_claims_own_results_are_not() -> None:
    assert not state(
        a=record(device("gpu-3-mig-1g10gb-19-1", mig_on="gpu-3", uuid="MIG-1", start=1)),
        b=record(device("gpu-3-mig-1g10gb-19-2", mig_on="gpu-3", uuid="MIG-2", start=2)),
        c=record(device("gpu-4", admin=True)),
        d=record(device("gpu-4"), device("gpu-4")),
        e=record(device("gpu-6", share_id="0b7c6d4e-0000-4000-8000-000000000001")),
        f=record(device("gpu-6", share_id="0b7c6d4e-0000-4000-8000-000000000002")),
        g=record(device("gpu-6", admin=True)),
        h=record(device("gpu-0-mig-3g40gb-9-0", admin=True)),
        i=record(device("gpu-0-mig-3g40gb-9-0")),
    ).double_allocations()


def test_missed_goals_name_every_nonzero_fault_and_a_slow_republish() -> None:
    figures = {
        "kill9.runs": 10,
        "kill9.kills": 9,
        "kill9.leaked_specs": 2,
        "fuzz.crashes": 0,
        "outage.republish_after_return_max_s": 7.5,
    }
    assert missed_goals(figures) == [
        "kill9.leaked_specs = 2 (goal 0)",
        "outage.republish_after_return_max_s = 7.5 (goal <= 5.0)",
    ]
    assert not missed_goals({"kill9.runs": 10, "kill9.kills": 9, "fuzz.crashes": 0})


def test_kill9_plans_cover_every_kind_and_place_claims_as_the_scheduler_could() -> None:
    """Any len(KINDS) runs in a row have a claim of each kind; no plan holds a memory slice twice, nor
    gives admin access to a GPU it passes through; a crash point of passthrough only where a claim
    passes a GPU through; every seventh run has two instances and every seventh another loses the
    store (deleted, corrupted)."""
    rng = random.Random(1)
    plans = [kill9.plan_run(rng, number) for number in range(400)]
    every = len(kill9.KINDS)
    for start in range(0, 400 - every, every):
        assert {c.kind for plan in plans[start : start + every] for c in plan.claims} == set(kill9.KINDS)
    for number, plan in enumerate(plans):
        records = {
            str(index): record(
                device(
                    claim.device,
                    admin=claim.kind.startswith("admin-"),
                    share_id=f"0b7c6d4e-0000-4000-8000-{index:012}" if claim.kind == "share" else None,
                )
            )
            for index, claim in enumerate(plan.claims)
        }
        assert not state(**records).double_allocations(), plan
        passed = {c.device.replace("-vfio-", "-") for c in plan.claims if c.kind == "passthrough"}
        assert not {c.device for c in plan.claims if c.kind == "admin-gpu"} & passed, plan
        if plan.crash_point is not None and plan.crash_point.startswith("vfio."):
            assert passed, plan
        assert not (plan.second_instance and plan.store_loss), plan
        if number % 7 == 3:
            assert plan.second_instance
        if number % 7 == 5:
            assert plan.store_loss == ("deleted", "corrupted")[number // 7 % 2]
            assert plan.recovery_crash_point is not None
