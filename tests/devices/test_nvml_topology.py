"""The in-node topology through NVML's C interface (the mock library) and sysfs.

The mock machines are the simulator's servers: a DGX H100 (NVSwitch, all-to-all), a PCIe server of
eight H100 NVL cards bridged in pairs, a box of four L40S without NVLink, and a GB200 tray. NVLink
comes from NVML (link state, the far end's device type and PCI address); the PCIe root and switch
and the NUMA node from a sysfs tree laid out as the simulator's server of the same kind. The NVML
backend must find what the simulator reports: the same islands, switches, roots and NUMA nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.topology import nvlink_islands
from dra_driver.devices.types import Inventory
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.nodes import node_profile, pci_place
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs, install_sysfs

MACHINES = {  # mock machine -> the simulator's profile of the same server
    "dgxh100": "dgx-h100",
    "pcieh100nvl": "pcie-h100nvl-bridged",
    "l40s": "l40s-4",
    "gb200nvl72": "gb200-tray",
}

Grouping = list[list[int]]


@pytest.fixture(scope="session")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def read(tmp_path: Path, mock: MockNvml) -> Iterator[Callable[..., Inventory]]:
    """The inventory of a fresh mock machine, its sysfs laid out as the simulator's ``profile``."""
    opened: list[NvmlBackend] = []

    def make(machine: str, *commands: str, numa: int | None = None, sysfs: bool = True) -> Inventory:
        host = tmp_path / f"host-{len(opened)}"
        root = install_driver_root(host / "driver-root")
        mock.configure(machine, proc_root=install_procfs(host / "proc"))
        for command in commands:
            mock.control(command)
        bus_ids = [f"0000:{gpu['busId'][9:].lower()}" for gpu in mock.state()["gpus"]]
        if sysfs:
            profile = node_profile(MACHINES[machine])
            places = [pci_place(profile, i, len(bus_ids)) for i in range(len(bus_ids))]
            install_sysfs(
                host / "sys",
                [
                    (bus, p.root, p.switch, p.numa_node if numa is None else numa)
                    for bus, p in zip(bus_ids, places, strict=True)
                ],
            )
        backend = NvmlBackend(sysfs_root=host / "sys", dev_root=root, driver_root=root, read_only=True)
        opened.append(backend)
        return backend.inventory()

    yield make
    for backend in opened:
        backend.close()


def islands(inventory: Inventory) -> Grouping:
    return grouped(
        inventory,
        {g.uuid: island for g in inventory.gpus if (island := nvlink_islands(inventory.gpus).get(g.uuid))},
    )


def grouped(inventory: Inventory, value: dict[str, object]) -> Grouping:
    """GPU indices grouped by ``value`` (GPUs without one left out)."""
    groups: dict[object, list[int]] = {}
    for gpu in inventory.gpus:
        if gpu.uuid in value:
            groups.setdefault(value[gpu.uuid], []).append(gpu.index)
    return sorted(groups.values())


def topology(inventory: Inventory) -> dict[str, object]:
    """Everything the topology attributes are made of, free of addresses that differ per machine."""
    return {
        "nvlink islands": islands(inventory),
        "pcie switches": grouped(inventory, {g.uuid: g.pcie_switch for g in inventory.gpus if g.pcie_switch}),
        "pcie roots": grouped(inventory, {g.uuid: g.pcie_root for g in inventory.gpus if g.pcie_root}),
        "numa nodes": [g.numa_node for g in inventory.gpus],
    }


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_nvml_finds_the_topology_the_simulator_reports(
    machine: str, read: Callable[..., Inventory], tmp_path: Path
) -> None:
    simulated = SimulatedBackend(MACHINES[machine], "node-1", tmp_path / "sim").inventory()
    assert topology(read(machine)) == topology(simulated)


def test_the_three_servers(read: Callable[..., Inventory]) -> None:
    assert islands(read("dgxh100")) == [list(range(8))]
    assert islands(read("pcieh100nvl")) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert islands(read("l40s")) == []


def test_a_bridged_pair_reads_its_partners_address(read: Callable[..., Inventory]) -> None:
    gpus = read("pcieh100nvl").gpus
    assert gpus[0].nvlink_remotes == (gpus[1].pci_bus_id,)
    assert gpus[1].nvlink_remotes == (gpus[0].pci_bus_id,)


def test_a_pulled_bridge_takes_the_pair_out_of_every_island(read: Callable[..., Inventory]) -> None:
    inventory = read("pcieh100nvl", "nvlink 2 all down", "nvlink 3 all down")
    assert islands(inventory) == [[0, 1], [4, 5], [6, 7]]


def test_one_failed_link_of_a_bridge_keeps_the_pair(read: Callable[..., Inventory]) -> None:
    assert islands(read("pcieh100nvl", "nvlink 0 0 down", "nvlink 1 0 down")) == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
    ]


def test_a_switch_without_a_pci_address_still_joins_its_gpus(read: Callable[..., Inventory]) -> None:
    # The DGX's NVSwitches stop telling their address (the GB200 tray's never do): one island still.
    inventory = read("dgxh100", "fail nvmlDeviceGetNvLinkRemotePciInfo_v2 999")
    assert islands(inventory) == [list(range(8))]
    assert {g.nvlink_remotes for g in inventory.gpus} == {("nvswitch",)}


def test_no_numa_node_and_no_sysfs_mean_no_attribute_values(read: Callable[..., Inventory]) -> None:
    assert {g.numa_node for g in read("l40s", numa=-1).gpus} == {None}
    inventory = read("pcieh100nvl", sysfs=False)
    assert {(g.numa_node, g.pcie_switch, g.pcie_root) for g in inventory.gpus} == {(None, None, None)}
