"""NVLink islands from the far ends of each GPU's links, and the three kinds of server the simulator
models: an NVSwitch board (all-to-all), a PCIe server with NVLink bridges in pairs, a PCIe box
without NVLink."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dra_driver.devices.topology import NVSWITCH_WITHOUT_ADDRESS, nvlink_islands
from dra_driver.devices.types import DeviceNode, FabricInfo, Gpu, Inventory
from dra_driver.simulated.gpus import SimulatedBackend


def gpu(index: int, *remotes: str, bus: str = "", fabric: FabricInfo | None = None) -> Gpu:
    return Gpu(
        uuid=f"GPU-{index}",
        minor=index,
        index=index,
        product_name="NVIDIA H100 NVL",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability=(9, 0),
        memory_bytes=1,
        multiprocessors=132,
        pci_bus_id=bus or f"0000:{0x10 + index:02x}:00.0",
        pci_device_id=0x2321,
        pci_vendor_id=0x10DE,
        device_node=DeviceNode(f"/dev/nvidia{index}", 195, index),
        nvlink_remotes=remotes,
        fabric=fabric,
    )


def groups(islands: dict[str, str]) -> list[list[str]]:
    """The islands as sorted lists of GPU uuids, whatever their ids."""
    by_id: dict[str, list[str]] = {}
    for uuid, island in islands.items():
        by_id.setdefault(island, []).append(uuid)
    return sorted(sorted(members) for members in by_id.values())


def test_bridged_pairs_are_islands_of_two_named_by_their_lowest_bus_id() -> None:
    gpus = [gpu(0, "0000:11:00.0"), gpu(1, "0000:10:00.0"), gpu(2, "0000:13:00.0"), gpu(3, "0000:12:00.0")]
    assert nvlink_islands(gpus) == {
        "GPU-0": "0000:10:00.0",
        "GPU-1": "0000:10:00.0",
        "GPU-2": "0000:12:00.0",
        "GPU-3": "0000:12:00.0",
    }


def test_a_link_seen_from_one_end_only_still_joins_the_pair() -> None:
    # One GPU's link state read fails (NVML answers for one end and not the other): still one island.
    assert groups(nvlink_islands([gpu(0, "0000:11:00.0"), gpu(1)])) == [["GPU-0", "GPU-1"]]


def test_gpus_on_the_same_nvswitches_are_one_island() -> None:
    switches = ("0000:05:00.0", "0000:06:00.0")
    gpus = [gpu(i, *switches) for i in range(4)]
    assert groups(nvlink_islands(gpus)) == [["GPU-0", "GPU-1", "GPU-2", "GPU-3"]]
    assert set(nvlink_islands(gpus).values()) == {"0000:10:00.0"}  # a switch's bus id never names one


def test_switches_without_an_address_are_one_endpoint() -> None:
    gpus = [gpu(i, NVSWITCH_WITHOUT_ADDRESS) for i in range(2)]
    assert groups(nvlink_islands(gpus)) == [["GPU-0", "GPU-1"]]


def test_gpus_without_a_peer_are_in_no_island() -> None:
    # Two GPUs without NVLink, and one whose links lead only to a switch no other GPU reaches.
    assert nvlink_islands([gpu(0), gpu(1), gpu(2, "0000:05:00.0")]) == {}


def test_gpus_of_two_fabric_cliques_never_share_an_island() -> None:
    one = FabricInfo("76c7d4f7-82be-58c7-9c42-0480cc88c498", 1)
    two = replace(one, clique_id=2)
    gpus = [gpu(i, NVSWITCH_WITHOUT_ADDRESS, fabric=one if i < 2 else two) for i in range(4)]
    assert groups(nvlink_islands(gpus)) == [["GPU-0", "GPU-1"], ["GPU-2", "GPU-3"]]


def simulated(tmp_path: Path, profile: str) -> Inventory:
    return SimulatedBackend(profile, "node-1", tmp_path, boot_id_path=tmp_path / "boot_id").inventory()


def by_minor(inventory: Inventory, value: dict[str, str]) -> list[list[int]]:
    """Groups of GPU minors with the same value."""
    minors = {g.uuid: g.minor for g in inventory.gpus}
    found: dict[str, list[int]] = {}
    for uuid, key in value.items():
        found.setdefault(key, []).append(minors[uuid])
    return sorted(sorted(group) for group in found.values())


def test_a_dgx_h100_is_one_nvswitch_island_on_two_sockets(tmp_path: Path) -> None:
    inventory = simulated(tmp_path, "dgx-h100")
    assert by_minor(inventory, nvlink_islands(inventory.gpus)) == [list(range(8))]
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len({g.pcie_root for g in inventory.gpus}) == 8
    assert {g.pcie_switch for g in inventory.gpus} == {None}


def test_the_pcie_server_has_bridged_pairs_behind_one_switch_per_socket(tmp_path: Path) -> None:
    inventory = simulated(tmp_path, "pcie-h100nvl-bridged")
    assert by_minor(inventory, nvlink_islands(inventory.gpus)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    switches = {g.uuid: g.pcie_switch or "" for g in inventory.gpus}
    roots = {g.uuid: g.pcie_root or "" for g in inventory.gpus}
    assert by_minor(inventory, switches) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert by_minor(inventory, roots) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    # Behind a switch: the GPU's bus comes after the switch's, under the same root bus.
    for g in inventory.gpus:
        assert g.pcie_root is not None
        assert g.pcie_switch is not None
        assert int(g.pcie_root[-2:], 16) < int(g.pcie_switch[5:7], 16) < int(g.pci_bus_id[5:7], 16)


def test_the_l40s_box_has_no_nvlink(tmp_path: Path) -> None:
    inventory = simulated(tmp_path, "l40s-4")
    assert nvlink_islands(inventory.gpus) == {}
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 1, 1]
    assert len({g.pcie_root for g in inventory.gpus}) == 4


def test_a_gb200_tray_is_one_island_in_its_clique(tmp_path: Path) -> None:
    inventory = simulated(tmp_path, "gb200-tray")
    assert by_minor(inventory, nvlink_islands(inventory.gpus)) == [[0, 1, 2, 3]]
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 1, 1]  # two Grace CPUs, two GPUs each
