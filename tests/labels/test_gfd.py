"""GFD-format node labels: GFD's names and value formats, following MIG changes and lost GPUs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dra_driver.labels.gfd import family, gfd_labels, mig_resource_name, sanitise
from dra_driver.labels.labeller import is_managed, label_patch
from dra_driver.simulated.gpus import SimulatedBackend


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend("dgx-h100", "node-1", tmp_path)


def test_a_dgx_h100_gets_gfds_labels(backend: SimulatedBackend) -> None:
    labels = gfd_labels(backend.inventory(), machine="DGX H100")

    assert {k: v for k, v in labels.items() if not k.startswith("nvidia.com/cuda.")} == {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.machine": "DGX-H100",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.family": "hopper",
        "nvidia.com/gpu.compute.major": "9",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mps.capable": "false",
    }
    assert labels["nvidia.com/cuda.driver-version.full"] == "580.95.05"
    assert labels["nvidia.com/cuda.driver-version.revision"] == labels["nvidia.com/cuda.driver.rev"] == "05"
    assert labels["nvidia.com/cuda.runtime-version.full"] == "13.0"


def test_mig_devices_get_per_profile_labels_and_go_with_them(backend: SimulatedBackend) -> None:
    backend.admin_set_mig_mode(2, True)
    made = [backend.admin_create_mig(2, "1g.10gb+me", 0), backend.admin_create_mig(2, "3g.40gb", 4)]

    labels = gfd_labels(backend.inventory())

    assert labels["nvidia.com/gpu.count"] == "8"  # GFD counts GPUs in MIG mode too
    assert labels["nvidia.com/mig-1g.10gb.me.count"] == "1"
    assert labels["nvidia.com/mig-1g.10gb.me.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me"
    assert labels["nvidia.com/mig-3g.40gb.memory"] == "40448"
    assert labels["nvidia.com/mig-3g.40gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig-3g.40gb.engines.decoder"] == "3"
    for mig in made:
        backend.destroy_mig_device(backend.inventory().gpus[2].uuid, mig.uuid)
    assert not any(k.startswith("nvidia.com/mig-") for k in gfd_labels(backend.inventory()))


def test_lost_gpus_are_not_counted_and_a_node_without_gpus_has_no_labels(backend: SimulatedBackend) -> None:
    inventory = backend.inventory()
    uuids = [gpu.uuid for gpu in inventory.gpus]

    assert gfd_labels(inventory, lost=uuids[:3])["nvidia.com/gpu.count"] == "5"
    assert gfd_labels(inventory, lost=uuids) == {}


@pytest.mark.parametrize(
    ("text", "label"),
    [("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"), ("Tesla T4", "Tesla-T4"), ("A (B) / C", "A-B-C")],
)
def test_sanitise_like_gfd(text: str, label: str) -> None:
    assert sanitise(text) == label


def test_families_like_gfd() -> None:
    assert [family(*cc) for cc in [(7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (10, 0), (12, 0), (4, 0)]] == [
        "volta", "turing", "ampere", "ada-lovelace", "hopper", "blackwell", "blackwell", "undefined",
    ]  # fmt: skip


def test_mig_profiles_are_named_like_the_device_plugin() -> None:
    assert mig_resource_name("1g.10gb+me") == "1g.10gb.me"
    assert mig_resource_name("3g.40gb") == "3g.40gb"


def test_the_patch_touches_only_gfds_own_labels() -> None:
    current = {
        "kubernetes.io/hostname": "n1",
        "nvidia.com/gpu.deploy.driver": "true",  # the GPU operator's, not ours
        "nvidia.com/gpu.count": "8",
        "nvidia.com/mig-3g.40gb.count": "1",
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    }
    desired = {"nvidia.com/gpu.count": "7", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}

    assert label_patch(current, desired) == {
        "nvidia.com/gpu.count": "7",
        "nvidia.com/mig-3g.40gb.count": None,
    }
    assert not is_managed("nvidia.com/gpu.deploy.driver")
    assert not is_managed("example.com/gpu.count")
    assert is_managed("nvidia.com/mig-1g.10gb.me.engines.ofa")
