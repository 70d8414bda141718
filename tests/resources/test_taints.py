"""From GPU faults to taints on every device of the GPU, and to the health the kubelet is told."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dra_driver.devices.faults import Fault, FaultKind
from dra_driver.devices.types import HealthState
from dra_driver.resources.devices import build_devices, partition_all
from dra_driver.resources.slices import split_pool
from dra_driver.resources.taints import (
    TAINTS_PER_DEVICE_MAX,
    DeviceHealth,
    TaintEffect,
    TaintPolicy,
    device_health,
    device_taints,
    faults_to_taint,
    gpu_taints,
    unknown_gpus,
)

from .factories import DRIVER, a100_40gb, h100, inventory, mig_device, with_mig_devices

T0 = 1_800_000_000  # 2027-01-15T08:00:00Z
POLICY = TaintPolicy(driver_name=DRIVER)


def xid(number: int, since: int = T0) -> Fault:
    return Fault(FaultKind.XID, since=since, xid=number)


LOST = Fault(FaultKind.GPU_LOST, since=T0 + 1)
UNMONITORED = Fault(FaultKind.UNMONITORED, since=T0, detail="NVML offers no Xid events for this GPU")


def test_an_xid_taints_the_gpu_and_every_partition_of_it_with_the_time_it_was_seen() -> None:
    node = inventory(h100(0), h100(1))
    taints = device_taints(node, {node.gpus[1].uuid: (xid(48),)}, POLICY)

    published = [d for gpu in build_devices(node, partition=partition_all) for d in gpu.devices]
    of_gpu_1 = {d["name"] for d in published if d["name"] == "gpu-1" or d["name"].startswith("gpu-1-mig-")}
    assert len(of_gpu_1) == 26  # the full GPU and its 25 placements
    assert of_gpu_1 <= taints.keys()
    assert not any(name == "gpu-0" or name.startswith("gpu-0-") for name in taints)
    assert taints["gpu-1-mig-1g10gb-19-6"] == [
        {"key": f"{DRIVER}/xid", "effect": "NoSchedule", "value": "48", "timeAdded": "2027-01-15T08:00:00Z"}
    ]


def test_a_static_mig_device_of_a_faulty_gpu_is_tainted_too() -> None:
    gpu = a100_40gb(2, mig_enabled=True)
    gpu = with_mig_devices(gpu, mig_device(gpu, "3g.20gb", 4))
    node = inventory(gpu)
    taints = device_taints(node, {gpu.uuid: (xid(94),)}, POLICY)
    devices = build_devices(node, partition=partition_all, taints=taints)
    (static,) = [d for g in devices for d in g.devices if "uuid" in d["attributes"]]
    assert static.get("taints") == taints[static["name"]]


def test_xids_that_mean_the_gpu_is_gone_and_a_lost_gpu_evict() -> None:
    taints = gpu_taints((xid(48), xid(79), LOST, UNMONITORED), POLICY)
    assert [(t["key"], t.get("value"), t["effect"]) for t in taints] == [
        (f"{DRIVER}/gpu-lost", None, "NoExecute"),
        (f"{DRIVER}/unmonitored", None, "None"),
        (f"{DRIVER}/xid", "48", "NoSchedule"),
        (f"{DRIVER}/xid", "79", "NoExecute"),
    ]


def test_the_effects_follow_the_policy() -> None:
    policy = TaintPolicy(
        driver_name="gpu.nvidia.com",
        xid_effect=TaintEffect.NO_EXECUTE,
        gpu_lost_effect=TaintEffect.NO_SCHEDULE,
        gpu_lost_xids=frozenset({48}),
    )
    taints = gpu_taints((xid(48), xid(94), LOST), policy)
    assert [(t["key"], t.get("value"), t["effect"]) for t in taints] == [
        ("gpu.nvidia.com/gpu-lost", None, "NoSchedule"),
        ("gpu.nvidia.com/xid", "48", "NoSchedule"),
        ("gpu.nvidia.com/xid", "94", "NoExecute"),
    ]


def test_republishing_the_same_faults_publishes_the_same_slices() -> None:
    node = inventory(h100(0), h100(1), h100(2))
    faults = {node.gpus[2].uuid: (xid(79), LOST)}

    def slices() -> object:
        return split_pool(build_devices(node, taints=device_taints(node, faults, POLICY)))

    assert slices() == slices()


@given(st.lists(st.integers(min_value=1, max_value=200), min_size=17, max_size=60, unique=True))
def test_a_gpu_with_very_many_xids_keeps_the_most_severe_and_newest_within_the_api_limit(
    numbers: list[int],
) -> None:
    faults = [xid(number, since=T0 + i) for i, number in enumerate(numbers)] + [LOST]
    taints = gpu_taints(faults, POLICY)
    assert len(taints) == TAINTS_PER_DEVICE_MAX
    assert {"key": f"{DRIVER}/gpu-lost", "effect": "NoExecute", "timeAdded": "2027-01-15T08:00:01Z"} in taints
    kept = {int(t["value"]) for t in taints if "value" in t}
    severe = [n for n in numbers if n in POLICY.gpu_lost_xids]
    newest = [n for n in reversed(numbers) if n not in POLICY.gpu_lost_xids]
    assert kept == {*severe, *newest[: TAINTS_PER_DEVICE_MAX - 1 - len(severe)]}


def test_faults_of_a_gpu_the_node_does_not_have_taint_nothing_and_are_named() -> None:
    node = inventory(h100(0))
    faults = {"GPU-not-here": (xid(79),)}
    assert device_taints(node, faults, POLICY) == {}
    assert unknown_gpus(node, faults) == ["GPU-not-here"]


def test_taints_go_when_the_gpu_recovers() -> None:
    tainted = {"GPU-a": (xid(79),)}
    assert faults_to_taint(tainted, {}, POLICY) == {}


def test_taints_can_be_kept_after_recovery_as_nvidias_driver_does() -> None:
    keep = TaintPolicy(driver_name=DRIVER, remove_on_recovery=False)
    tainted = faults_to_taint({}, {"GPU-a": (xid(79),)}, keep)
    tainted = faults_to_taint(tainted, {"GPU-a": (xid(48, since=T0 + 5),)}, keep)
    tainted = faults_to_taint(tainted, {}, keep)
    assert tainted == {"GPU-a": (xid(79), xid(48, since=T0 + 5))}


def test_the_kubelet_hears_unhealthy_with_the_faults_and_unknown_when_unmonitored() -> None:
    node = inventory(h100(0), h100(1), h100(2))
    health = device_health(node, {node.gpus[0].uuid: (xid(79), LOST), node.gpus[1].uuid: (UNMONITORED,)})
    assert health["gpu-0-mig-7g80gb-0-0"] == DeviceHealth(
        HealthState.UNHEALTHY,
        "Xid 79 (GPU has fallen off the bus) since 2027-01-15T08:00:00Z; "
        "GPU lost: NVML cannot reach it since 2027-01-15T08:00:01Z",
    )
    assert health["gpu-1"].state is HealthState.UNKNOWN
    assert "gpu-2" not in health  # healthy
