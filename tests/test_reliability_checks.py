"""The fault suite's own judgement (e2e/reliability): what counts as a device held twice, a missed goal."""

from __future__ import annotations

from dra_driver.node.records import ClaimRecord, DeviceRecord, MigRecord
from e2e.reliability.plugin import NodeState
from e2e.reliability.suite import missed_goals


def record(*devices: DeviceRecord) -> ClaimRecord:
    return ClaimRecord(namespace="ns", name="c", phase="PrepareCompleted", attempt="a", devices=devices)


def device(
    name: str, *, admin: bool = False, mig_on: str | None = None, uuid: str | None = None
) -> DeviceRecord:
    mig = (
        MigRecord(
            parent_uuid="GPU-x",
            parent_device=mig_on,
            profile_id=19,
            placement_start=0,
            placement_size=1,
            uuid=uuid,
        )
        if mig_on
        else None
    )
    return DeviceRecord(
        request="r", pool="p", device=name, admin_access=admin, cdi_device_ids=("k=x",), mig=mig
    )


def state(**records: ClaimRecord) -> NodeState:
    return NodeState(specs=frozenset(), records=records, mig_devices=(), temp_files=())


def test_one_device_in_two_records_is_a_double_allocation() -> None:
    assert state(a=record(device("gpu-1")), b=record(device("gpu-1"))).double_allocations() == [
        "gpu-1: ['a', 'b']"
    ]


def test_a_full_gpu_and_a_mig_device_on_it_for_two_claims_is_a_double_allocation() -> None:
    found = state(
        a=record(device("gpu-2")), b=record(device("gpu-2-mig-x", mig_on="gpu-2"))
    ).double_allocations()
    assert found == ["gpu-2 whole for ['a'] and MIG for ['b']"]


def test_one_mig_uuid_recorded_for_two_claims_is_a_double_allocation() -> None:
    a = record(device("gpu-3-mig-1", mig_on="gpu-3", uuid="MIG-1"))
    b = record(device("gpu-3-mig-2", mig_on="gpu-3", uuid="MIG-1"))
    assert state(a=a, b=b).double_allocations() == ["MIG-1: ['a', 'b']"]


def test_mig_devices_of_one_gpu_admin_access_and_one_claims_own_results_are_not() -> None:
    assert not state(
        a=record(device("gpu-3-mig-1", mig_on="gpu-3", uuid="MIG-1")),
        b=record(device("gpu-3-mig-2", mig_on="gpu-3", uuid="MIG-2")),
        c=record(device("gpu-4", admin=True)),
        d=record(device("gpu-4"), device("gpu-4")),
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
