"""docs/nvidia-compatibility.md's attribute table against the devices the driver publishes.

Every row: the attribute or capacity is on every device of the kinds it names, with its type,
and its example selector reads it. And the other way round: nothing NVIDIA-named is published
that the table leaves out, so the table is the complete list.
"""

from __future__ import annotations

import re

import pytest

from dra_driver.resources.devices import build_devices
from dra_driver.resources.wire import Device
from dra_driver.simulated.gpus import SimulatedBackend
from tests.nvidia_table import Row, read_table

ROWS = read_table()
# The doc's "Added by this driver"; the topology attributes are in docs/topology.md.
OURS_ONLY = {"vendor", "pciVendorID", "pciDeviceID", "nvlinkIsland", "nvlinkClique", "pcieSwitch"}
MAX_ATTRIBUTES_AND_CAPACITIES = 32  # per device, resource.k8s.io/v1


def kind_of(device: Device) -> str:
    if device["attributes"]["type"]["string"] == "gpu":
        return "gpu"
    return "existing mig" if "uuid" in device["attributes"] else "mig"


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> list[Device]:
    """A simulated GB200 tray (Grace: it has an addressing mode) with one static MIG device."""
    backend = SimulatedBackend("gb200-tray", "node-1", tmp_path_factory.mktemp("sim"))
    try:
        backend.admin_set_mig_mode(3, True)
        backend.admin_create_mig(3, "3g.93gb", 4)
        inventory = backend.inventory()
    finally:
        backend.close()
    return [device for gpu in build_devices(inventory) for device in gpu.devices]


def carriers(row: Row, devices: list[Device]) -> list[Device]:
    wanted = set(row.devices) | ({"existing mig"} if "mig" in row.devices else set())
    return [device for device in devices if kind_of(device) in wanted]


def values(row: Row, device: Device) -> list[dict[str, str]]:
    section = device["attributes"] if row.kind == "attribute" else device["capacity"]
    if row.name == "memorySlice<N>":
        return [v for k, v in section.items() if re.fullmatch(r"memorySlice\d", k)]  # type: ignore[misc]
    value = section.get(row.name)
    return [value] if value is not None else []  # type: ignore[list-item]


def test_the_table_lists_nvidias_attributes() -> None:
    assert {row.name for row in ROWS} >= {
        "type", "uuid", "productName", "brand", "architecture", "cudaComputeCapability",
        "driverVersion", "cudaDriverVersion", "addressingMode", "resource.kubernetes.io/pciBusID",
        "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode", "pcieBusID", "parentUUID",
        "profile", "memory",
        "multiprocessors", "copyEngines", "decoders", "encoders", "jpegEngines", "ofaEngines",
        "memorySlice<N>",
    }  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_each_row_is_published_with_its_type_on_its_devices(row: Row, devices: list[Device]) -> None:
    targets = carriers(row, devices)
    assert targets, f"no published device is of kind {sorted(row.devices)}"
    for device in targets:
        found = values(row, device)
        assert found, f"{device['name']} lacks {row.kind} {row.name}"
        for value in found:
            assert list(value) == [row.wire_key], f"{device['name']}: {row.name} is {value}, not a {row.type}"


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_each_example_selector_reads_its_row(row: Row) -> None:
    domain, _, name = row.name.rpartition("/")
    section = "attributes" if row.kind == "attribute" else "capacity"
    expected = f'device.{section}["{domain or "gpu.nvidia.com"}"]'
    assert expected in row.selector
    assert name.replace("<N>", "") in row.selector


def test_nothing_nvidia_named_is_missing_from_the_table(devices: list[Device]) -> None:
    listed = {row.name for row in ROWS}
    for device in devices:
        published = set(device["attributes"]) | {
            "memorySlice<N>" if re.fullmatch(r"memorySlice\d", k) else k for k in device["capacity"]
        }
        assert published - listed <= OURS_ONLY, device["name"]


def test_every_device_stays_within_the_api_limit(devices: list[Device]) -> None:
    for device in devices:
        assert len(device["attributes"]) + len(device["capacity"]) <= MAX_ATTRIBUTES_AND_CAPACITIES
