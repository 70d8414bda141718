"""A node's NVLink clique from its GPUs' fabric info, as NVML reports it."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pynvml

from dra_driver.devices.fabric import fabric_from_nvml, node_clique
from dra_driver.devices.types import FabricInfo, FabricState, Inventory
from dra_driver.simulated.gpus import SimulatedBackend

CLUSTER = uuid.UUID("8a2d6e1c-1b1e-4a3e-9f0a-2b6c1d7e5f40")


def test_nvmls_fields_become_the_clique_nvidia_names() -> None:
    info = fabric_from_nvml(CLUSTER.bytes, 7, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, "Success")
    assert info == FabricInfo(str(CLUSTER), 7, FabricState.COMPLETED, "Success")
    assert info.clique == f"{CLUSTER}.7"


def test_a_gpu_without_nvlink_fabric_has_no_fabric_info() -> None:
    assert fabric_from_nvml(bytes(16), 0, pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, "Success") is None


def _tray(tmp_path: Path, fabric: str = "1") -> Inventory:
    return SimulatedBackend("gb200-tray", "tray", tmp_path, fabric=f"{CLUSTER}/{fabric}").inventory()


def _with(inventory: Inventory, index: int, fabric: FabricInfo | None) -> Inventory:
    gpus = list(inventory.gpus)
    gpus[index] = dataclasses.replace(gpus[index], fabric=fabric)
    return dataclasses.replace(inventory, gpus=tuple(gpus))


def test_a_node_joins_the_clique_all_its_gpus_completed_registration_in(tmp_path: Path) -> None:
    assert node_clique(_tray(tmp_path)).clique == f"{CLUSTER}.1"


def test_a_gpu_still_registering_keeps_the_node_out(tmp_path: Path) -> None:
    inventory = _with(_tray(tmp_path), 2, FabricInfo(str(CLUSTER), 1, FabricState.IN_PROGRESS))
    clique = node_clique(inventory)
    assert clique.clique == ""
    assert "fabric registration has not completed" in clique.reason
    assert "(InProgress)" in clique.reason


def test_gpus_in_two_cliques_keep_the_node_out(tmp_path: Path) -> None:
    inventory = _with(_tray(tmp_path), 0, FabricInfo(str(CLUSTER), 2))
    assert "in 2 NVLink cliques" in node_clique(inventory).reason


def test_a_gpu_without_fabric_info_keeps_the_node_out(tmp_path: Path) -> None:
    inventory = _with(_tray(tmp_path), 3, None)
    assert node_clique(inventory).reason.startswith("GPUs without NVLink fabric info: GPU-")


def test_a_registration_in_no_cluster_is_no_multi_node_fabric() -> None:
    """NVLink inside the node only: completed, but with a zero cluster UUID (NVIDIA's rule)."""
    assert fabric_from_nvml(bytes(16), 0, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, "Success") is None


def test_a_failed_registration_keeps_the_node_out_and_says_so(tmp_path: Path) -> None:
    failed = FabricInfo(str(CLUSTER), 1, FabricState.COMPLETED, "Insufficient Resources")
    inventory = _with(_tray(tmp_path), 1, failed)
    clique = node_clique(inventory)
    assert not clique.clique
    assert clique.reason == (
        f"GPUs whose fabric registration failed: {inventory.gpus[1].uuid} (Insufficient Resources)"
    )
