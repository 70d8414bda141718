"""Passthrough devices in the pool: NVIDIA's names and attributes, and counters that keep the
scheduler from allocating one beside its GPU or a MIG device of it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from dra_driver.devices.pci import PassthroughGpu
from dra_driver.devices.types import Gpu
from dra_driver.resources.devices import GpuDevices, build_devices, partition_all, partition_none
from dra_driver.resources.wire import Device

from .factories import a100_40gb, h100, inventory, mig_device

H100_BARS = 256 << 30  # an H100's 64-bit BARs (128 GiB and 32 MiB), rounded up as NVIDIA's driver does


def places(*gpus: Gpu, iommufd: bool = False, bars: int | None = H100_BARS) -> dict[str, PassthroughGpu]:
    return {
        gpu.pci_bus_id: PassthroughGpu(index, gpu.pci_bus_id, 20 + index, iommufd, bars)
        for index, gpu in enumerate(sorted(gpus, key=lambda g: g.pci_bus_id))
    }


def devices(gpus: Sequence[GpuDevices]) -> dict[str, Device]:
    return {device["name"]: device for gpu in gpus for device in gpu.devices}


def consumed(device: Device) -> dict[str, int]:
    (consumption,) = device.get("consumesCounters", [])
    return {name: int(counter["value"]) for name, counter in consumption["counters"].items()}


def test_no_passthrough_device_without_the_setting() -> None:
    assert not any(name.startswith("gpu-vfio-") for name in devices(build_devices(inventory(h100(0)))))


def test_each_gpu_gets_nvidias_passthrough_device() -> None:
    gpus = (h100(0), h100(1))
    built = devices(build_devices(inventory(*gpus), passthrough=places(*gpus, iommufd=True)))
    vfio = built["gpu-vfio-1"]
    assert vfio["attributes"] == {
        "type": {"string": "vfio"},
        "uuid": {"string": "5194ebd7-9948-5f9d-aa24-b11deb707948"},  # uuid5(DNS, "0000:19:00.0"), as NVIDIA's
        "deviceID": {"string": "0x2330"},
        "vendorID": {"string": "0x10de"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "iommuFDEnabled": {"bool": True},
        "resource.kubernetes.io/pciBusID": {"string": "0000:19:00.0"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:18"},
    }
    # NVIDIA's one capacity of a passthrough device: the window a VM's firmware maps for the GPU
    assert vfio["capacity"] == {"addressableMemory": {"value": str(H100_BARS)}}


def test_a_passthrough_device_whose_bars_sysfs_does_not_give_has_no_addressable_memory() -> None:
    built = devices(build_devices(inventory(h100(0)), passthrough=places(h100(0), bars=None)))
    assert built["gpu-vfio-0"]["capacity"] == {}


@pytest.mark.parametrize("partition", [partition_all, partition_none], ids=["dynamic-mig", "no-mig"])
def test_the_passthrough_device_consumes_its_whole_gpu_as_the_full_gpu_does(partition: object) -> None:
    gpu = h100(0)
    (built,) = build_devices(inventory(gpu), partition=partition, passthrough=places(gpu))  # type: ignore[arg-type]
    assert built.counter_set is not None
    everything = {name: int(counter["value"]) for name, counter in built.counter_set["counters"].items()}
    named = devices([built])
    assert consumed(named["gpu-vfio-0"]) == everything
    assert consumed(named["gpu-0"]) == everything
    # Whatever else consumes from the set (a MIG placement), nothing fits beside the passthrough device.
    for name, device in named.items():
        if name != "gpu-vfio-0" and "consumesCounters" in device:
            assert any(consumed(device)[c] > 0 for c in everything), name


def test_a_gpu_in_mig_mode_or_with_mig_devices_has_no_passthrough_device() -> None:
    in_mig_mode = a100_40gb(0, mig_enabled=True)
    with_mig = h100(1, mig_enabled=True)
    with_mig = h100(1, mig_enabled=True, mig_devices=(mig_device(with_mig, "1g.10gb", 0),))
    idle = h100(2)
    gpus = (in_mig_mode, with_mig, idle)
    built = devices(build_devices(inventory(*gpus), passthrough=places(*gpus)))
    assert sorted(name for name in built if name.startswith("gpu-vfio-")) == ["gpu-vfio-2"]


def test_a_gpu_not_in_an_iommu_group_has_no_passthrough_device() -> None:
    gpus = (h100(0), h100(1))
    built = devices(build_devices(inventory(*gpus), passthrough=places(gpus[1])))
    assert [name for name in built if name.startswith("gpu-vfio-")] == ["gpu-vfio-0"]
    assert built["gpu-vfio-0"]["attributes"]["resource.kubernetes.io/pciBusID"] == {
        "string": gpus[1].pci_bus_id
    }
