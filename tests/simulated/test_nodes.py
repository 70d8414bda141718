"""What a simulated node looks like: its GPUs, their identities and the driver's device nodes."""

from __future__ import annotations

import re

import pytest

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.fabric import node_clique
from dra_driver.devices.types import DeviceNode
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.nodes import NODE_PROFILES

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
BUS_ID = re.compile(r"^0000:[0-9a-f]{2}:00\.0$")


def _backend(tmp_path, profile="dgx-h100", node="node-a"):
    return SimulatedBackend(profile, node, tmp_path / node)


@pytest.mark.parametrize(
    ("profile", "count", "products"),
    [
        ("dgx-h100", 8, {"NVIDIA H100 80GB HBM3"}),
        ("hgx-h100-16", 16, {"NVIDIA H100 80GB HBM3"}),
        ("dgx-a100-40gb", 8, {"NVIDIA A100-SXM4-40GB"}),
        ("dgx-a100-80gb", 8, {"NVIDIA A100-SXM4-80GB"}),
        ("dgx-h200", 8, {"NVIDIA H200"}),
        ("dgx-b200", 8, {"NVIDIA B200"}),
        ("gb200-tray", 4, {"NVIDIA GB200"}),
        ("l4x4", 4, {"NVIDIA L4"}),
        ("mixed", 6, {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"}),
        ("pcie-h100nvl-bridged", 8, {"NVIDIA H100 NVL"}),
        ("l40s-4", 4, {"NVIDIA L40S"}),
    ],
)
def test_profiles_have_their_gpus(tmp_path, profile, count, products):
    gpus = _backend(tmp_path, profile).inventory().gpus
    assert len(gpus) == count
    assert {g.product_name for g in gpus} == products


def test_every_registered_profile_is_tested():
    assert set(NODE_PROFILES) == {
        "dgx-h100",
        "hgx-h100-16",
        "dgx-a100-40gb",
        "dgx-a100-80gb",
        "dgx-h200",
        "dgx-b200",
        "gb200-tray",
        "l4x4",
        "mixed",
        "pcie-h100nvl-bridged",
        "l40s-4",
    }


def test_identities_look_like_real_ones(tmp_path):
    inventory = _backend(tmp_path, "hgx-h100-16").inventory()
    for index, gpu in enumerate(inventory.gpus):
        assert GPU_UUID.match(gpu.uuid)
        assert BUS_ID.match(gpu.pci_bus_id)
        assert gpu.pcie_root is not None
        assert re.match(r"^pci0000:[0-9a-f]{2}$", gpu.pcie_root)
        assert (gpu.index, gpu.minor) == (index, index)
        assert gpu.device_node == DeviceNode(f"/dev/nvidia{index}", 195, index)
    assert len({g.uuid for g in inventory.gpus}) == 16
    assert len({g.pci_bus_id for g in inventory.gpus}) == 16
    # 16 GPUs on 8 root complexes: two GPUs share each root
    assert len({g.pcie_root for g in inventory.gpus}) == 8


def test_same_node_name_gives_the_same_gpus(tmp_path):
    first = SimulatedBackend("dgx-h100", "node-a", tmp_path / "one").inventory()
    second = SimulatedBackend("dgx-h100", "node-a", tmp_path / "two").inventory()
    assert first == second


def test_other_nodes_get_other_uuids_in_the_same_server_layout(tmp_path):
    a = _backend(tmp_path, node="node-a").inventory()
    b = _backend(tmp_path, node="node-b").inventory()
    assert not {g.uuid for g in a.gpus} & {g.uuid for g in b.gpus}
    assert [g.pci_bus_id for g in a.gpus] == [g.pci_bus_id for g in b.gpus]


def test_dgx_h100_gpu0_sits_behind_its_own_root_complex(tmp_path):
    gpu0 = _backend(tmp_path).inventory().gpus[0]
    assert (gpu0.pci_bus_id, gpu0.pcie_root) == ("0000:1b:00.0", "pci0000:1a")
    assert (gpu0.pci_device_id, gpu0.pci_vendor_id) == (0x2330, 0x10DE)


def test_driver_versions_and_control_nodes(tmp_path):
    inventory = _backend(tmp_path).inventory()
    assert inventory.driver_version == "580.95.05"
    assert inventory.cuda_driver_version == (13, 0)
    assert {n.path: (n.major, n.minor) for n in inventory.control_nodes} == {
        "/dev/nvidiactl": (195, 255),
        "/dev/nvidia-modeset": (195, 254),
        "/dev/nvidia-uvm": (510, 0),
        "/dev/nvidia-uvm-tools": (510, 1),
    }


def test_gpus_start_powered_on_without_mig(tmp_path):
    for gpu in _backend(tmp_path, "mixed").inventory().gpus:
        assert not gpu.mig_enabled
        assert gpu.mig_devices == ()


def test_mixed_node_covers_each_mig_behaviour(tmp_path):
    by_product = {g.product_name: g for g in _backend(tmp_path, "mixed").inventory().gpus}
    h100, a100, l4 = (by_product[n] for n in ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB", "NVIDIA L4"))
    assert h100.mig_capable
    assert not h100.mig_mode_change_requires_reset
    assert a100.mig_capable
    assert a100.mig_mode_change_requires_reset
    assert not l4.mig_capable
    assert l4.mig_profiles == ()
    assert a100.profile("1g.5gb") is not None
    assert h100.profile("1g.10gb") is not None


def test_unknown_profile_names_the_known_ones(tmp_path):
    with pytest.raises(DeviceError, match=r"dgx-h100.*mixed"):
        _backend(tmp_path, "dgx-h1000")


def test_inventory_renders_as_json_data(tmp_path):
    data = _backend(tmp_path, "l4x4").inventory().as_dict()
    assert data["driver_version"] == "580.95.05"
    assert data["cuda_driver_version"] == [13, 0]
    assert data["gpus"][0]["device_node"] == {
        "path": "/dev/nvidia0",
        "major": 195,
        "minor": 0,
        "host_path": None,
    }


def test_nvl72_trays_report_the_clique_they_are_configured_for(tmp_path):
    cluster = "8a2d6e1c-1b1e-4a3e-9f0a-2b6c1d7e5f40"
    one = SimulatedBackend("gb200-tray", "tray-1", tmp_path / "1", fabric=f"{cluster}/1").inventory()
    two = SimulatedBackend("gb200-tray", "tray-2", tmp_path / "2", fabric=f"{cluster}/2").inventory()
    assert {g.fabric.clique for g in one.gpus if g.fabric} == {f"{cluster}.1"}
    assert {g.fabric.clique for g in two.gpus if g.fabric} == {f"{cluster}.2"}
    assert node_clique(one).clique != node_clique(two).clique


def test_nvl72_trays_share_the_default_clique_unless_told(tmp_path):
    one = SimulatedBackend("gb200-tray", "tray-1", tmp_path / "1").inventory()
    two = SimulatedBackend("gb200-tray", "tray-2", tmp_path / "2").inventory()
    assert node_clique(one).clique
    assert node_clique(one) == node_clique(two)


def test_gpus_without_multi_node_nvlink_have_no_fabric(tmp_path):
    inventory = _backend(tmp_path, "dgx-h100").inventory()
    assert all(g.fabric is None for g in inventory.gpus)
    with pytest.raises(DeviceError, match="no multi-node NVLink"):
        SimulatedBackend("dgx-h100", "n", tmp_path / "x", fabric="1")


def test_a_malformed_fabric_is_refused_with_the_expected_form(tmp_path):
    with pytest.raises(DeviceError, match="is not <cluster-uuid>/<clique-id>"):
        SimulatedBackend("gb200-tray", "n", tmp_path / "x", fabric="rack-a/one")
