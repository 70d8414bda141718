from __future__ import annotations

from collections import Counter as Tally

from hypothesis import given, settings
from hypothesis import strategies as st

from dra_driver.devices.types import Inventory
from dra_driver.names import is_dns_label
from dra_driver.resources.devices import (
    GpuDevices,
    PartitionPolicy,
    build_devices,
    partition_all,
    partition_none,
    partition_selected,
)
from dra_driver.resources.slices import slice_specs, split_pool
from dra_driver.resources.wire import Device, DeviceTaint, ResourceSliceSpec

from .factories import DRIVER, NODE, h100, inventories, inventory


def specs_for(gpus: list[GpuDevices], generation: int = 3) -> list[ResourceSliceSpec]:
    return slice_specs(split_pool(gpus), driver=DRIVER, node_name=NODE, generation=generation)


def shape(specs: list[ResourceSliceSpec]) -> list[tuple[str, int]]:
    return [
        ("counters", len(spec["sharedCounters"]))
        if "sharedCounters" in spec
        else ("devices", len(spec["devices"]))
        for spec in specs
    ]


def test_eight_partitioned_h100s_need_one_counter_slice_and_four_device_slices() -> None:
    specs = specs_for(build_devices(inventory(*(h100(i) for i in range(8)))))
    # 26 devices per GPU (full GPU + 25 placements), all consuming counters: two GPUs per slice.
    assert shape(specs) == [("counters", 8)] + [("devices", 52)] * 4


def test_sixteen_partitioned_h100s_need_two_counter_slices() -> None:
    specs = specs_for(build_devices(inventory(*(h100(i) for i in range(16)))))
    assert shape(specs) == [("counters", 8), ("counters", 8)] + [("devices", 52)] * 8


def test_a_gpus_devices_stay_in_one_slice() -> None:
    specs = specs_for(build_devices(inventory(*(h100(i) for i in range(3)))))
    device_slices = [[d["name"] for d in spec["devices"]] for spec in specs if "devices" in spec]
    assert [names[0] for names in device_slices] == ["gpu-0", "gpu-2"]
    assert all(name.startswith("gpu-2") for name in device_slices[1])


def test_plain_devices_fill_slices_of_128() -> None:
    specs = specs_for(build_devices(inventory(*(h100(i) for i in range(200))), partition=partition_none))
    assert shape(specs) == [("devices", 128), ("devices", 72)]


def test_one_tainted_device_lowers_its_slices_limit_to_64() -> None:
    taint: DeviceTaint = {"key": "gpu.dra-driver.dev/gpu-lost", "effect": "NoExecute"}
    gpus = build_devices(
        inventory(*(h100(i) for i in range(100))), partition=partition_none, taints={"gpu-30": [taint]}
    )
    assert shape(specs_for(gpus)) == [("devices", 64), ("devices", 36)]


def test_a_tainted_device_that_would_overfill_a_slice_starts_the_next_one() -> None:
    taint: DeviceTaint = {"key": "gpu.dra-driver.dev/gpu-lost", "effect": "NoExecute"}
    gpus = build_devices(
        inventory(*(h100(i) for i in range(100))), partition=partition_none, taints={"gpu-70": [taint]}
    )
    assert shape(specs_for(gpus)) == [("devices", 70), ("devices", 30)]


def test_a_group_larger_than_any_slice_is_split() -> None:
    big: tuple[Device, ...] = tuple(
        {
            "name": f"part-{i}",
            "attributes": {},
            "capacity": {},
            "consumesCounters": [{"counterSet": "set", "counters": {"c": {"value": "1"}}}],
        }
        for i in range(100)
    )
    contents = split_pool([GpuDevices(devices=big)])
    assert [len(content.devices) for content in contents] == [64, 36]


def test_an_empty_node_publishes_one_empty_slice_so_the_pool_is_visible() -> None:
    specs = specs_for(build_devices(inventory()))
    assert specs == [
        {
            "driver": DRIVER,
            "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 1},
            "nodeName": NODE,
            "devices": [],
        }
    ]


def test_a_counter_slice_holds_counter_sets_only() -> None:
    gpus = build_devices(inventory(h100(0)))
    [counters, devices] = specs_for(gpus)
    assert counters == {
        "driver": DRIVER,
        "pool": {"name": NODE, "generation": 3, "resourceSliceCount": 2},
        "nodeName": NODE,
        "sharedCounters": [gpus[0].counter_set],
    }
    assert "sharedCounters" not in devices


def test_splitting_is_deterministic() -> None:
    node = inventory(*(h100(i) for i in range(5)))
    assert split_pool(build_devices(node)) == split_pool(build_devices(node))


partition_policies = st.one_of(
    st.just(partition_all),
    st.just(partition_none),
    st.sets(st.integers(0, 255).map(str)).map(partition_selected),
)


@settings(max_examples=60, deadline=None)
@given(node=inventories(), partition=partition_policies, generation=st.integers(0, 2**40), data=st.data())
def test_every_slice_respects_every_api_limit(
    node: Inventory, partition: PartitionPolicy, generation: int, data: st.DataObject
) -> None:
    names_to_taint = data.draw(st.sets(st.sampled_from([f"gpu-{gpu.minor}" for gpu in node.gpus])))
    taint: DeviceTaint = {"key": "gpu.dra-driver.dev/xid", "value": "48", "effect": "NoSchedule"}
    gpus = build_devices(
        node,
        partition=partition,
        taints={name: [taint] for name in names_to_taint},
    )
    specs = specs_for(gpus, generation)

    published_devices = [device for spec in specs for device in spec.get("devices", [])]
    published_sets = [counter_set for spec in specs for counter_set in spec.get("sharedCounters", [])]
    assert published_devices == [device for gpu in gpus for device in gpu.devices]  # each once, in order
    assert published_sets == [gpu.counter_set for gpu in gpus if gpu.counter_set is not None]
    assert not [n for n, count in Tally(d["name"] for d in published_devices).items() if count > 1]
    assert len({s["name"] for s in published_sets}) == len(published_sets)

    for spec in specs:
        assert spec["pool"] == {"name": NODE, "generation": generation, "resourceSliceCount": len(specs)}
        assert spec["driver"] == DRIVER
        assert spec["nodeName"] == NODE
        assert ("devices" in spec) != ("sharedCounters" in spec)
        devices = spec.get("devices", [])
        limited = any(device.get("taints") or device.get("consumesCounters") for device in devices)
        assert len(devices) <= (64 if limited else 128)
        assert len(spec.get("sharedCounters", [])) <= 8
        for counter_set in spec.get("sharedCounters", []):
            assert len(counter_set["counters"]) <= 32
            assert is_dns_label(counter_set["name"])
            assert all(is_dns_label(counter) for counter in counter_set["counters"])
        for device in devices:
            assert is_dns_label(device["name"])
            assert len(device["attributes"]) + len(device["capacity"]) <= 32
            assert len(device.get("taints", [])) <= 16
            assert len(device.get("consumesCounters", [])) <= 2

    counters_of = {s["name"]: s["counters"] for s in published_sets}
    for device in published_devices:
        for consumption in device.get("consumesCounters", []):
            assert set(consumption["counters"]) <= set(counters_of[consumption["counterSet"]])


@settings(max_examples=30, deadline=None)
@given(node=inventories())
def test_a_gpu_whose_devices_fit_one_slice_is_never_split(node: Inventory) -> None:
    gpus = build_devices(node)
    slice_of = {
        device["name"]: index for index, content in enumerate(split_pool(gpus)) for device in content.devices
    }
    for gpu in gpus:
        assert len({slice_of[device["name"]] for device in gpu.devices}) <= 1


# --- Kubernetes 1.34: a device consumes counters only from its own slice ------------------------------


@settings(max_examples=60, deadline=None)
@given(node=inventories(), partition=partition_policies, data=st.data())
def test_on_1_34_every_device_finds_its_counters_in_its_own_slice_within_1_34s_limits(
    node: Inventory, partition: PartitionPolicy, data: st.DataObject
) -> None:
    names_to_taint = data.draw(st.sets(st.sampled_from([f"gpu-{gpu.minor}" for gpu in node.gpus])))
    taint: DeviceTaint = {"key": "gpu.dra-driver.dev/xid", "value": "48", "effect": "NoSchedule"}
    gpus = build_devices(node, partition=partition, taints={name: [taint] for name in names_to_taint})

    specs = slice_specs(
        split_pool(gpus, counters_beside_devices=True), driver=DRIVER, node_name=NODE, generation=1
    )

    published = [device for spec in specs for device in spec.get("devices", [])]
    assert sorted(d["name"] for d in published) == sorted(d["name"] for gpu in gpus for d in gpu.devices)
    for spec in specs:
        own_sets = {s["name"]: s["counters"] for s in spec.get("sharedCounters", [])}
        # 1.34's limits: 128 devices, 32 counters over all sets, 1024 counters consumed in a slice.
        assert len(spec["devices"]) <= 128
        assert sum(len(counters) for counters in own_sets.values()) <= 32
        consumed = [c for d in spec["devices"] for c in d.get("consumesCounters", [])]
        assert sum(len(c["counters"]) for c in consumed) <= 1024
        for consumption in consumed:
            assert set(consumption["counters"]) <= set(own_sets[consumption["counterSet"]])


def test_on_1_34_each_partitioned_gpu_gets_one_slice_with_its_counter_set_and_devices() -> None:
    gpus = build_devices(inventory(*(h100(i) for i in range(3))))
    specs = slice_specs(
        split_pool(gpus, counters_beside_devices=True), driver=DRIVER, node_name=NODE, generation=1
    )
    assert [(len(s["sharedCounters"]), len(s["devices"])) for s in specs] == [(1, 26)] * 3
    assert [s["devices"][0]["name"] for s in specs] == ["gpu-0", "gpu-1", "gpu-2"]


def test_on_1_34_gpus_without_partitions_are_packed_as_on_newer_releases() -> None:
    gpus = build_devices(inventory(*(h100(i) for i in range(200))), partition=partition_none)
    assert split_pool(gpus, counters_beside_devices=True) == split_pool(gpus)
