"""Golden ResourceSlices of every simulated node with MIG-capable GPUs, with MIG partitions on.

Two kinds of golden file pin the whole pool between them:

* ``golden/gpus/<model>-<state>.yaml``: everything one GPU of a model publishes -- its counter set
  and every device with all its attributes, capacities and counters -- in each state the scheduler
  meets: ``mig-off`` (only where MIG mode switches on without a reset: the full GPU next to its
  placements) and ``mig-on`` (an administrator switched it on, or the driver did for a MIG device:
  placements only, since CUDA cannot use the GPU whole then);
* ``golden/pools/<node profile>.yaml``: how the node's pool splits into ResourceSlices, as powered
  on and with MIG mode on for every GPU: the counter sets and the device names of each slice.

The other GPUs of a node differ from the first of their model only in identity (uuid, minor, PCI
address), which the pool files show through the names. Regenerate after an intended change with
``UPDATE_GOLDEN=1 .venv/bin/pytest tests/resources/test_golden_slices.py`` and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.devices.catalog import gpu_model
from dra_driver.devices.types import Inventory
from dra_driver.gpu_plugin.policies import desired_slices
from dra_driver.resources.devices import build_devices, partition_all
from dra_driver.resources.slices import (
    MAX_COUNTER_SETS_PER_SLICE,
    MAX_COUNTERS_PER_SET,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS,
    SliceContent,
)
from dra_driver.settings import Settings
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.nodes import NODE_PROFILES

GOLDEN = Path(__file__).parent / "golden"
NODE = "node-1"
MAX_COUNTER_SETS_PER_DEVICE = 2

MIG_NODE_PROFILES = sorted(
    name
    for name, profile in NODE_PROFILES.items()
    if any(gpu_model(m).mig_capable for m in profile.gpu_models)
)
MIG_GPU_MODELS = sorted(
    {
        model
        for name in MIG_NODE_PROFILES
        for model in NODE_PROFILES[name].gpu_models
        if gpu_model(model).mig_capable
    }
)


def node_inventory(profile: str, directory: Path, *, mig_mode_on: bool) -> Inventory:
    """A simulated node as powered on, or after an administrator switched MIG mode on everywhere."""
    backend = SimulatedBackend(profile, NODE, directory, boot_id_path=directory / "boot_id")
    if mig_mode_on:
        for gpu in backend.inventory().gpus:
            if gpu.mig_capable:
                backend.admin_set_mig_mode(gpu.index, True)
    return backend.inventory()


def check_against_golden(name: str, data: Any) -> None:
    text = yaml.safe_dump(data, sort_keys=False, width=110)
    golden = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; UPDATE_GOLDEN=1 rewrites it (review the diff)"


def check_api_limits(slices: list[SliceContent]) -> None:
    """What the API server checks of a pool's slices (resource.k8s.io/v1, 1.35+)."""
    counter_sets = {cs["name"]: cs["counters"] for s in slices for cs in s.shared_counters}
    for content in slices:
        assert not (content.devices and content.shared_counters), "devices and counters share a slice"
        assert len(content.shared_counters) <= MAX_COUNTER_SETS_PER_SLICE
        assert all(len(cs["counters"]) <= MAX_COUNTERS_PER_SET for cs in content.shared_counters)
        assert len(content.devices) <= MAX_DEVICES_PER_SLICE_WITH_TAINTS_OR_COUNTERS
        for device in content.devices:
            consumed = device.get("consumesCounters", [])
            assert len(consumed) <= MAX_COUNTER_SETS_PER_DEVICE
            for use in consumed:
                assert set(use["counters"]) <= set(counter_sets[use["counterSet"]]), device["name"]


def pool_layout(slices: list[SliceContent]) -> list[dict[str, Any]]:
    return [
        {"counterSets": {cs["name"]: len(cs["counters"]) for cs in content.shared_counters}}
        if content.shared_counters
        else {"devices": [device["name"] for device in content.devices]}
        for content in slices
    ]


@pytest.mark.parametrize("profile", MIG_NODE_PROFILES)
def test_pool_layout_matches_golden(profile: str, tmp_path: Path) -> None:
    settings = Settings(node_name=NODE, mig_partitions="all")
    layouts: dict[str, Any] = {}
    for state, mig_mode_on in (("powered-on", False), ("mig-mode-on", True)):
        slices = desired_slices(settings, node_inventory(profile, tmp_path / state, mig_mode_on=mig_mode_on))
        check_api_limits(slices)
        layouts[state] = {"slices": len(slices), "layout": pool_layout(slices)}
    check_against_golden(f"pools/{profile}.yaml", layouts)


# MIG mode off, an Ampere GPU offers no partitions: switching it on needs a reset.
GPU_STATES = [
    (model, state)
    for model in MIG_GPU_MODELS
    for state in (("mig-on",) if gpu_model(model).mig_mode_change_requires_reset else ("mig-off", "mig-on"))
]


@pytest.mark.parametrize(("model", "state"), GPU_STATES)
def test_one_gpu_matches_golden(model: str, state: str, tmp_path: Path) -> None:
    profile = next(name for name in MIG_NODE_PROFILES if NODE_PROFILES[name].gpu_models[0] == model)
    inventory = node_inventory(profile, tmp_path, mig_mode_on=state == "mig-on")

    first = build_devices(inventory, partition=partition_all)[0]

    assert first.counter_set is not None
    check_against_golden(
        f"gpus/{model}-{state}.yaml", {"counterSet": first.counter_set, "devices": list(first.devices)}
    )


def test_every_mig_capable_simulated_gpu_and_node_has_golden_slices() -> None:
    assert set(MIG_NODE_PROFILES) == {
        "dgx-a100-40gb",
        "dgx-a100-80gb",
        "dgx-b200",
        "dgx-h100",
        "dgx-h200",
        "gb200-tray",
        "hgx-h100-16",
        "mixed",
        "pcie-h100nvl-bridged",
    }
    assert set(MIG_GPU_MODELS) == {
        "a100-sxm4-40gb",
        "a100-sxm4-80gb",
        "b200-180gb",
        "gb200",
        "h100-nvl-94gb",
        "h100-sxm5-80gb",
        "h200-sxm-141gb",
    }
