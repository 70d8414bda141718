"""--mig-partitions: which GPUs offer MIG placements, and what auto means under each driver name."""

from __future__ import annotations

import pytest

from dra_driver.gpu_plugin.policies import partition_policy
from dra_driver.resources.devices import build_devices
from dra_driver.settings import Settings
from tests.resources.factories import h100, inventory

OURS, NVIDIAS = "gpu.dra-driver.dev", "gpu.nvidia.com"


def published(setting: str, driver_name: str, *, mig_enabled: bool) -> dict[str, object]:
    gpus = build_devices(
        inventory(h100(0, mig_enabled=mig_enabled)), partition=partition_policy(setting, driver_name)
    )
    return {device["name"]: device for gpu in gpus for device in gpu.devices}


def test_auto_is_the_default_and_offers_every_gpu_under_the_drivers_own_name() -> None:
    assert Settings(node_name="n").mig_partitions == "auto"
    devices = published("auto", OURS, mig_enabled=False)
    assert "consumesCounters" in devices["gpu-0"]  # MIG placements beside it: it consumes them all
    assert any("-mig-" in name for name in devices)


def test_under_nvidias_name_auto_leaves_a_full_gpu_without_counters() -> None:
    """So an admin-access claim through NVIDIA's gpu.nvidia.com class gets the GPU a workload holds."""
    devices = published("auto", NVIDIAS, mig_enabled=False)
    assert list(devices) == ["gpu-0"]
    assert "consumesCounters" not in devices["gpu-0"]


@pytest.mark.parametrize("setting", ["auto", "mig-mode"])
def test_a_gpu_an_administrator_put_in_mig_mode_keeps_dynamic_mig(setting: str) -> None:
    devices = published(setting, NVIDIAS, mig_enabled=True)
    assert "gpu-0" not in devices  # MIG mode on: no full GPU, as before
    assert "gpu-0-mig-1g10gb-19-0" in devices


def test_all_and_a_list_keep_their_meaning_under_nvidias_name() -> None:
    assert "consumesCounters" in published("all", NVIDIAS, mig_enabled=False)["gpu-0"]
    assert "consumesCounters" in published("0", NVIDIAS, mig_enabled=False)["gpu-0"]
    assert list(published("none", OURS, mig_enabled=False)) == ["gpu-0"]


def test_the_keywords_are_read_in_any_case() -> None:
    assert Settings(node_name="n", mig_partitions=" MIG-Mode ").mig_partitions == "mig-mode"
