"""What a claim's ``matchAttribute`` compares: the topology attributes each device carries."""

from __future__ import annotations

from dataclasses import replace

from dra_driver.devices.types import FabricInfo, FabricState
from dra_driver.resources.devices import build_devices
from dra_driver.resources.wire import Device
from tests.resources.factories import h100, inventory, mig_device, with_mig_devices

NUMA_NODE = "resource.kubernetes.io/numaNode"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"


def devices_of(*gpus: object) -> dict[str, Device]:
    return {d["name"]: d for gpu in build_devices(inventory(*gpus)) for d in gpu.devices}  # type: ignore[arg-type]


def attribute(device: Device, name: str) -> object:
    value = device["attributes"].get(name)
    return None if value is None else next(iter(value.values()))


def test_bridged_gpus_share_an_island_and_unbridged_ones_have_none() -> None:
    gpus = [
        replace(h100(0), nvlink_remotes=(h100(1).pci_bus_id,)),
        replace(h100(1), nvlink_remotes=(h100(0).pci_bus_id,)),
        h100(2),
    ]
    devices = devices_of(*gpus)
    assert attribute(devices["gpu-0"], "nvlinkIsland") == h100(0).pci_bus_id
    assert attribute(devices["gpu-1"], "nvlinkIsland") == h100(0).pci_bus_id
    assert attribute(devices["gpu-2"], "nvlinkIsland") is None


def test_numa_node_is_on_every_device_of_the_gpu_and_absent_where_unknown() -> None:
    static = mig_device(h100(0), "3g.40gb", 0)
    on_numa = with_mig_devices(replace(h100(0), numa_node=1, mig_enabled=True), static)
    devices = devices_of(on_numa, replace(h100(1), numa_node=None))
    of_gpu_0 = [d for name, d in devices.items() if name.startswith("gpu-0-")]
    assert len(of_gpu_0) > 1  # the static MIG device and the placements beside it
    assert {str(d["attributes"][NUMA_NODE]) for d in of_gpu_0} == {str({"int": 1})}
    assert attribute(devices["gpu-1"], NUMA_NODE) is None


def test_pcie_switch_and_root_are_on_the_full_gpu() -> None:
    devices = devices_of(replace(h100(0), pcie_switch="0000:17:00.0"), h100(1))
    assert attribute(devices["gpu-0"], "pcieSwitch") == "0000:17:00.0"
    assert attribute(devices["gpu-0"], PCIE_ROOT) == h100(0).pcie_root
    assert attribute(devices["gpu-1"], "pcieSwitch") is None  # straight on a root port
    assert all("pcieSwitch" not in d["attributes"] for n, d in devices.items() if "-mig-" in n)


def test_the_clique_is_published_only_once_registration_succeeded() -> None:
    fabric = FabricInfo("76c7d4f7-82be-58c7-9c42-0480cc88c498", 3)
    devices = devices_of(
        replace(h100(0), fabric=fabric),
        replace(h100(1), fabric=replace(fabric, state=FabricState.IN_PROGRESS)),
        replace(h100(2), fabric=replace(fabric, status="Unknown Error")),
    )
    assert attribute(devices["gpu-0"], "nvlinkClique") == "76c7d4f7-82be-58c7-9c42-0480cc88c498.3"
    assert attribute(devices["gpu-1"], "nvlinkClique") is None
    assert attribute(devices["gpu-2"], "nvlinkClique") is None


def test_a_full_size_static_mig_device_on_a_grace_gpu_stays_within_the_api_limit() -> None:
    grace = replace(h100(0), addressing_mode="ATS", numa_node=0, mig_enabled=True)
    gpu = with_mig_devices(grace, mig_device(grace, "7g.80gb", 0))
    (device,) = devices_of(gpu).values()
    assert len(device["attributes"]) + len(device["capacity"]) == 32
    assert "pcieBusID" not in device["attributes"]  # the legacy duplicate of the standard pciBusID
    assert attribute(device, "resource.kubernetes.io/pciBusID") == grace.pci_bus_id
    assert attribute(device, NUMA_NODE) == 0
