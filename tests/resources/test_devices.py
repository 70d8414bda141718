from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dra_driver.devices.types import Gpu
from dra_driver.resources.devices import (
    GpuDevices,
    build_devices,
    partition_none,
    partition_selected,
    semver,
)
from dra_driver.resources.wire import Device, DeviceTaint

from .factories import MIB, a100_40gb, h100, inventory, mig_device, with_mig_devices

# The official semver 2.0.0 regular expression (semver.org).
SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


def only(gpus: list[GpuDevices]) -> GpuDevices:
    assert len(gpus) == 1
    return gpus[0]


def by_name(devices: tuple[Device, ...]) -> dict[str, Device]:
    return {device["name"]: device for device in devices}


def strings(device: Device) -> dict[str, str]:
    return {name: value["string"] for name, value in device["attributes"].items() if "string" in value}


# --- semver -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "published"),
    [
        ("580.95.05", "580.95.5"),
        ("13.0", "13.0.0"),
        ("9", "9.0.0"),
        ("550.54.15", "550.54.15"),
        ("0.0.00", "0.0.0"),
    ],
)
def test_semver_strips_leading_zeros_and_fills_missing_parts(raw: str, published: str) -> None:
    assert semver(raw) == published


@pytest.mark.parametrize("raw", ["", "580.95.05.1", "r580", "580.95-beta", " 580.95", "\u0663.\u0660"])
def test_semver_refuses_what_it_cannot_publish_faithfully(raw: str) -> None:
    with pytest.raises(ValueError, match="cannot publish version"):
        semver(raw)


number = st.from_regex(r"[0-9]{1,25}", fullmatch=True)
numeric_versions = st.lists(number, min_size=1, max_size=3).map(".".join)


@given(numeric_versions)
def test_semver_of_a_numeric_version_is_valid_and_keeps_its_numbers(raw: str) -> None:
    numbers = [int(part) for part in raw.split(".")]
    if len(".".join(str(n) for n in numbers + [0] * (3 - len(numbers)))) > 64:
        with pytest.raises(ValueError, match="longer than 64"):
            semver(raw)
        return
    published = semver(raw)
    assert SEMVER.match(published)
    assert [int(part) for part in published.split(".")] == numbers + [0] * (3 - len(numbers))


@given(st.text())
def test_semver_returns_valid_semver_or_refuses(raw: str) -> None:
    try:
        published = semver(raw)
    except ValueError:
        return
    assert SEMVER.match(published)
    assert len(published) <= 64


# --- full GPUs ----------------------------------------------------------------------------------


def test_a_full_gpu_carries_nvidias_attributes_and_capacities() -> None:
    gpu = h100(0)
    device = only(build_devices(inventory(gpu), partition=partition_none)).devices[0]
    assert device == {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": gpu.uuid},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Hopper"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "driverVersion": {"version": "580.95.5"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "vendor": {"string": "NVIDIA"},
            "pciVendorID": {"string": "0x10de"},
            "pciDeviceID": {"string": "0x2330"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
            "pcieBusID": {"string": "0000:18:00.0"},  # NVIDIA's name for it up to v25.8
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:17"},
        },
        "capacity": {
            "memory": {"value": str(81559 * MIB)},
            "multiprocessors": {"value": "132"},
            # MIG-capable: the engines of its largest profile (7g.80gb), as NVIDIA publishes them.
            "copyEngines": {"value": "8"},
            "decoders": {"value": "7"},
            "encoders": {"value": "0"},
            "jpegEngines": {"value": "7"},
            "ofaEngines": {"value": "1"},
        },
    }


def test_a_gpu_without_mig_has_no_engine_capacities_and_one_on_grace_has_an_addressing_mode() -> None:
    l4 = replace(h100(0), mig_capable=False, mig_profiles=(), memory_slices=0)
    grace = replace(h100(1), addressing_mode="ATS")
    plain, coherent = (
        gpu.devices[0] for gpu in build_devices(inventory(l4, grace), partition=partition_none)
    )
    assert set(plain["capacity"]) == {"memory", "multiprocessors"}
    assert "addressingMode" not in plain["attributes"]
    assert coherent["attributes"]["addressingMode"] == {"string": "ATS"}


def test_pcie_root_is_published_only_when_known() -> None:
    device = only(build_devices(inventory(a100_40gb(0)))).devices[0]
    assert "resource.kubernetes.io/pcieRoot" not in device["attributes"]
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:07:00.0"}


def test_gpus_come_out_ordered_by_minor_number() -> None:
    gpus = build_devices(inventory(h100(3), h100(1), h100(2)), partition=partition_none)
    assert [gpu.devices[0]["name"] for gpu in gpus] == ["gpu-1", "gpu-2", "gpu-3"]


def test_two_gpus_with_one_minor_number_are_refused() -> None:
    with pytest.raises(ValueError, match="both named 'gpu-0'"):
        build_devices(inventory(h100(0), a100_40gb(0)))


# --- dynamic MIG --------------------------------------------------------------------------------


def test_a_partitioned_gpu_offers_the_full_gpu_and_every_placement() -> None:
    gpu = only(build_devices(inventory(h100(0))))
    names = [device["name"] for device in gpu.devices]
    assert names[0] == "gpu-0"
    assert names[1:] == [
        *(f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)),
        *(f"gpu-0-mig-1g10gb-me-20-{start}" for start in range(7)),
        *(f"gpu-0-mig-1g20gb-15-{start}" for start in (0, 2, 4, 6)),
        *(f"gpu-0-mig-2g20gb-14-{start}" for start in (0, 2, 4)),
        "gpu-0-mig-3g40gb-9-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-0-mig-4g40gb-5-0",
        "gpu-0-mig-7g80gb-0-0",
    ]
    assert gpu.counter_set is not None
    assert gpu.counter_set["name"] == "gpu-0-counter-set"


def test_the_h100_counter_set_holds_what_the_largest_layouts_need() -> None:
    counter_set = only(build_devices(inventory(h100(0)))).counter_set
    assert counter_set is not None
    assert {name: counter["value"] for name, counter in counter_set["counters"].items()} == {
        "multiprocessors": "132",  # the full GPU and 7g.80gb
        "copy-engines": "8",  # 7g.80gb
        "decoders": "7",
        "encoders": "0",
        "jpeg-engines": "7",
        "ofa-engines": "1",  # one OFA per GPU: one 1g.10gb+me at a time
        "memory": str(81559 * MIB),  # the full GPU has more than any MIG layout
        **{f"memory-slice-{i}": "1" for i in range(8)},
    }


def test_the_full_gpu_consumes_every_counter_of_its_set() -> None:
    gpu = only(build_devices(inventory(h100(0))))
    assert gpu.counter_set is not None
    full = gpu.devices[0]
    assert full["consumesCounters"] == [
        {"counterSet": "gpu-0-counter-set", "counters": gpu.counter_set["counters"]}
    ]


def test_a_placement_device_consumes_its_share_and_exactly_its_memory_slices() -> None:
    gpu = h100(2)
    device = by_name(only(build_devices(inventory(gpu))).devices)["gpu-2-mig-3g40gb-9-4"]
    assert device["consumesCounters"] == [
        {
            "counterSet": "gpu-2-counter-set",
            "counters": {
                "multiprocessors": {"value": "60"},
                "copy-engines": {"value": "3"},
                "decoders": {"value": "3"},
                "encoders": {"value": "0"},
                "jpeg-engines": {"value": "3"},
                "ofa-engines": {"value": "0"},
                "memory": {"value": str(40448 * MIB)},
                **{f"memory-slice-{i}": {"value": "1"} for i in (4, 5, 6, 7)},
            },
        }
    ]
    assert device["capacity"] == {
        "multiprocessors": {"value": "60"},
        "copyEngines": {"value": "3"},
        "decoders": {"value": "3"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "3"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": str(40448 * MIB)},
    }


def test_a_placement_device_carries_its_profile_and_its_parents_identity() -> None:
    gpu = h100(0)
    devices = by_name(only(build_devices(inventory(gpu))).devices)
    placement = devices["gpu-0-mig-1g10gb-me-20-3"]
    parent_strings = strings(devices["gpu-0"])
    assert strings(placement) == {
        **{k: v for k, v in parent_strings.items() if k not in ("type", "uuid")},
        "type": "mig",
        "profile": "1g.10gb+me",
        "parentUUID": gpu.uuid,
    }
    versions = {name: value for name, value in placement["attributes"].items() if "version" in value}
    assert versions == {
        "cudaComputeCapability": {"version": "9.0.0"},
        "driverVersion": {"version": "580.95.5"},
        "cudaDriverVersion": {"version": "13.0.0"},
    }


def test_with_mig_mode_on_the_full_gpu_is_not_offered() -> None:
    gpu = only(build_devices(inventory(h100(0, mig_enabled=True))))
    assert "gpu-0" not in by_name(gpu.devices)
    assert len(gpu.devices) == 25


def test_an_ampere_gpu_with_mig_off_offers_no_partitions_because_enabling_mig_needs_a_reset() -> None:
    gpu = only(build_devices(inventory(a100_40gb(0))))
    assert [device["name"] for device in gpu.devices] == ["gpu-0"]
    assert gpu.counter_set is None
    assert "consumesCounters" not in gpu.devices[0]


def test_the_a100_counter_set_with_mig_mode_on() -> None:
    counter_set = only(build_devices(inventory(a100_40gb(0, mig_enabled=True)))).counter_set
    assert counter_set is not None
    assert {name: counter["value"] for name, counter in counter_set["counters"].items()} == {
        "multiprocessors": "98",
        "copy-engines": "7",
        "decoders": "5",
        "encoders": "0",
        "jpeg-engines": "1",
        "ofa-engines": "1",
        "memory": str(40192 * MIB),  # 7g.40gb; the full GPU is not offered in MIG mode
        **{f"memory-slice-{i}": "1" for i in range(8)},
    }


@pytest.mark.parametrize("mig_enabled", [False, True])
def test_without_partitions_a_gpu_publishes_no_placements_and_no_counters(mig_enabled: bool) -> None:
    gpu = only(build_devices(inventory(h100(0, mig_enabled=mig_enabled)), partition=partition_none))
    assert gpu.counter_set is None
    assert [device["name"] for device in gpu.devices] == ([] if mig_enabled else ["gpu-0"])


def test_partitions_can_be_limited_to_selected_gpus_by_uuid_or_minor() -> None:
    gpus = [h100(0), h100(1), h100(2)]
    result = build_devices(inventory(*gpus), partition=partition_selected({gpus[0].uuid, "2"}))
    assert [gpu.counter_set is not None for gpu in result] == [True, False, True]


def test_a_mig_device_the_driver_created_is_published_as_its_placement() -> None:
    gpu = h100(0)
    dynamic = mig_device(gpu, "3g.40gb", 4)
    gpu = with_mig_devices(gpu, dynamic)
    result = only(build_devices(inventory(gpu), owned_mig_uuids={dynamic.uuid}))
    device = by_name(result.devices)["gpu-0-mig-3g40gb-9-4"]
    assert "uuid" not in device["attributes"]
    assert "consumesCounters" in device
    assert len(result.devices) == 25  # every placement; only the full GPU is gone (MIG mode is on)


# --- binding conditions (KEP-5007) ----------------------------------------------------------------


def test_with_binding_conditions_only_the_placements_to_create_wait_for_the_node() -> None:
    gpu = h100(0)
    made = mig_device(gpu, "3g.40gb", 4)  # created by the driver for a claim
    static = mig_device(gpu, "1g.10gb", 0)  # made by an administrator: exists, nothing to wait for
    devices = by_name(
        only(
            build_devices(
                inventory(with_mig_devices(gpu, made, static)),
                owned_mig_uuids={made.uuid},
                binding_conditions=True,
            )
        ).devices
    )
    waiting = {name for name, device in devices.items() if "bindingConditions" in device}
    placements = {name for name, device in devices.items() if "uuid" not in device["attributes"]}
    assert waiting == placements
    assert "gpu-0-mig-3g40gb-9-4" in waiting  # a created device keeps its description
    assert static.uuid in {strings(d).get("uuid") for name, d in devices.items() if name not in waiting}
    placement = devices["gpu-0-mig-3g40gb-9-4"]
    assert placement["bindingConditions"] == ["Ready"]
    assert placement["bindingFailureConditions"] == ["PrepareFailed"]


def test_without_binding_conditions_no_device_carries_them() -> None:
    for gpu in build_devices(inventory(h100(0), a100_40gb(1))):
        for device in gpu.devices:
            assert "bindingConditions" not in device
            assert "bindingFailureConditions" not in device


def test_a_full_gpu_never_waits_for_binding() -> None:
    devices = by_name(only(build_devices(inventory(h100(0)), binding_conditions=True)).devices)
    assert "bindingConditions" not in devices["gpu-0"]


def test_a_shareable_gpu_waits_for_its_mps_daemon_only_with_share_binding_conditions_on() -> None:
    def gpu_0(**switches: bool) -> Device:
        return by_name(only(build_devices(inventory(h100(0)), consumable=True, **switches)).devices)["gpu-0"]

    shared = gpu_0(binding_conditions=True, share_binding_conditions=True)
    assert shared["allowMultipleAllocations"] is True
    assert shared["bindingConditions"] == ["Ready"]
    assert shared["bindingFailureConditions"] == ["PrepareFailed"]
    assert "bindingConditions" not in gpu_0(binding_conditions=True)  # MIG placements only: the default
    assert "bindingConditions" not in gpu_0()


# --- static MIG ---------------------------------------------------------------------------------


def test_a_static_mig_device_is_published_with_its_uuid_and_its_slices_are_not_offered_again() -> None:
    gpu = a100_40gb(1)
    static = mig_device(gpu, "3g.20gb", 0)
    result = only(build_devices(inventory(with_mig_devices(gpu, static))))
    devices = by_name(result.devices)
    concrete = devices["gpu-1-mig-3g20gb-9-0"]
    assert strings(concrete)["uuid"] == static.uuid
    assert strings(concrete)["type"] == "mig"
    assert "consumesCounters" not in concrete
    # The memory slices it occupies, as NVIDIA's driver publishes them for a MIG device that exists.
    assert {k: v for k, v in concrete["capacity"].items() if k.startswith("memorySlice")} == {
        f"memorySlice{i}": {"value": "1"} for i in range(4)
    }
    assert not any(k.startswith("memorySlice") for k in devices["gpu-1-mig-1g5gb-19-4"]["capacity"])
    assert "gpu-1" not in devices
    offered = {name for name, device in devices.items() if "consumesCounters" in device}
    # Only what fits in slices 4-7 next to the static 3g.20gb.
    assert offered == {
        "gpu-1-mig-1g5gb-19-4",
        "gpu-1-mig-1g5gb-19-5",
        "gpu-1-mig-1g5gb-19-6",
        "gpu-1-mig-1g5gb-me-20-4",
        "gpu-1-mig-1g5gb-me-20-5",
        "gpu-1-mig-1g5gb-me-20-6",
        "gpu-1-mig-1g10gb-15-4",
        "gpu-1-mig-1g10gb-15-6",
        "gpu-1-mig-2g10gb-14-4",
        "gpu-1-mig-3g20gb-9-4",
    }
    assert result.counter_set is not None
    counters = {name: counter["value"] for name, counter in result.counter_set["counters"].items()}
    assert counters["multiprocessors"] == "42"  # what is left: 3g.20gb@4, or 1g.5gb x3 (42), ...
    assert counters["memory"] == str(19968 * MIB)


def test_a_static_mig_device_counts_against_its_profiles_instance_limit() -> None:
    gpu = h100(0)
    static = mig_device(gpu, "1g.10gb+me", 0)  # the one +me instance an H100 allows
    devices = by_name(only(build_devices(inventory(with_mig_devices(gpu, static)))).devices)
    assert not [name for name in devices if "-me-20-" in name and name != "gpu-0-mig-1g10gb-me-20-0"]


def test_a_gpu_filled_by_static_mig_devices_has_no_counter_set() -> None:
    gpu = h100(0)
    static = mig_device(gpu, "7g.80gb", 0)
    result = only(build_devices(inventory(with_mig_devices(gpu, static))))
    assert result.counter_set is None
    assert [device["name"] for device in result.devices] == ["gpu-0-mig-7g80gb-0-0"]


def test_without_partitions_every_mig_device_is_concrete_even_one_the_driver_created() -> None:
    gpu = h100(0)
    created = mig_device(gpu, "2g.20gb", 2)
    result = only(
        build_devices(
            inventory(with_mig_devices(gpu, created)),
            partition=partition_none,
            owned_mig_uuids={created.uuid},
        )
    )
    assert [(device["name"], strings(device)["uuid"]) for device in result.devices] == [
        ("gpu-0-mig-2g20gb-14-2", created.uuid)
    ]


def test_a_mig_device_of_an_unknown_profile_is_reported_as_a_backend_fault() -> None:
    gpu = h100(0)
    device = mig_device(gpu, "1g.10gb", 0)
    broken = with_mig_devices(gpu, replace(device, profile="9g.99gb"))
    with pytest.raises(ValueError, match=r"profile '9g\.99gb'"):
        build_devices(inventory(broken))


# --- taints -------------------------------------------------------------------------------------

TAINT: DeviceTaint = {"key": "gpu.dra-driver.dev/xid", "value": "79", "effect": "NoExecute"}


def test_taints_are_attached_to_the_named_devices_only() -> None:
    taints = {"gpu-1": [TAINT], "gpu-9": [TAINT]}
    result = build_devices(inventory(h100(0), h100(1)), partition=partition_none, taints=taints)
    assert [device.get("taints") for gpu in result for device in gpu.devices] == [None, [TAINT]]


def test_more_than_sixteen_taints_on_a_device_are_refused() -> None:
    taints = {"gpu-0": [DeviceTaint(key=TAINT["key"], value=str(i), effect="NoSchedule") for i in range(17)]}
    with pytest.raises(ValueError, match="at most 16"):
        build_devices(inventory(h100(0)), taints=taints)


def test_publishing_is_deterministic() -> None:
    def node() -> list[GpuDevices]:
        gpus: list[Gpu] = [h100(1), a100_40gb(0, mig_enabled=True)]
        return build_devices(inventory(*gpus))

    assert node() == node()
