"""The operator commands, run as a user would: the console script in a subprocess."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.__main__ import main as dra_driver_main
from dra_driver.simulated.nodes import NODE_PROFILES


def dra_driver(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dra_driver", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_inventory_prints_the_gpus_and_the_slices_it_would_publish() -> None:
    result = dra_driver("inventory", "--simulate", "dgx-h100", "--node-name", "gpu-node-7")
    assert result.returncode == 0, result.stderr
    header = [line for line in result.stdout.splitlines() if line.startswith("#   gpu-")]
    assert len(header) == 8
    assert all("NVIDIA H100 80GB HBM3" in line for line in header)
    slices = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {s["kind"] for s in slices} == {"ResourceSlice"}
    devices = [d for s in slices for d in s["spec"].get("devices", [])]
    full_gpus = [d["name"] for d in devices if d["attributes"]["type"]["string"] == "gpu"]
    assert sorted(full_gpus) == [f"gpu-{i}" for i in range(8)]
    # Every MIG placement of every H100 is offered too: 25 per GPU (facts: 7+7+4+3+2+1+1).
    migs = [d for d in devices if d["attributes"]["type"]["string"] == "mig"]
    assert len(migs) == 8 * 25
    # And each GPU's maintenance device, for admin access (docs/maintenance.md).
    maintenance = [d["name"] for d in devices if d["attributes"]["type"]["string"] == "maintenance"]
    assert sorted(maintenance) == [f"gpu-{i}-maintenance" for i in range(8)]
    assert len(devices) == len(full_gpus) + len(migs) + len(maintenance)
    assert all(s["spec"]["nodeName"] == "gpu-node-7" for s in slices)
    assert all(s["spec"]["pool"]["resourceSliceCount"] == len(slices) for s in slices)
    # Written out in full, as kubectl would show it: no YAML anchors or aliases.
    assert "&id" not in result.stdout
    assert "*id" not in result.stdout


def test_inventory_lays_the_slices_out_for_the_release_it_is_given() -> None:
    def slices(*args: str) -> list[dict[str, Any]]:
        result = dra_driver("inventory", "--simulate", "dgx-h100", *args)
        assert result.returncode == 0, result.stderr
        return [doc for doc in yaml.safe_load_all(result.stdout) if doc]

    def devices(of: list[dict[str, Any]]) -> list[str]:
        return sorted(d["name"] for s in of for d in s["spec"].get("devices", []))

    newest, old = slices(), slices("--kubernetes-version", "v1.34")
    # From 1.35 counter sets have slices of their own; 1.34 keeps each beside the devices using it.
    assert not [s for s in newest if "sharedCounters" in s["spec"] and "devices" in s["spec"]]
    beside = [s for s in old if "sharedCounters" in s["spec"]]
    assert len(beside) == 8
    assert all(s["spec"].get("devices") for s in beside)
    assert devices(old) == devices(newest)
    assert slices("--kubernetes-version", "1.37.2") == newest

    bad = dra_driver("inventory", "--simulate", "dgx-h100", "--kubernetes-version", "34")
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "--kubernetes-version" in bad.stderr
    assert "'34' is not a Kubernetes release" in bad.stderr


def test_inventory_with_consumable_capacity_shows_shareable_gpus() -> None:
    result = dra_driver("inventory", "--simulate", "l4x4", "--consumable-capacity")
    assert result.returncode == 0, result.stderr
    devices = [d for s in yaml.safe_load_all(result.stdout) if s for d in s["spec"].get("devices", [])]
    shareable = {d["name"] for d in devices if d.get("allowMultipleAllocations")}
    assert shareable == {f"gpu-{i}" for i in range(4)}
    policy = next(d for d in devices if d["name"] == "gpu-0")["capacity"]["memory"]["requestPolicy"]
    assert policy["validRange"]["step"] == "1Gi"
    # The switch takes a value too, and the environment sets it as well.
    off = dra_driver("inventory", "--simulate", "l4x4", "--consumable-capacity", "false")
    assert off.returncode == 0, off.stderr
    assert "allowMultipleAllocations" not in off.stdout


def test_inventory_is_deterministic_per_node_name() -> None:
    first = dra_driver("inventory", "--simulate", "l4x4", "--node-name", "a").stdout
    again = dra_driver("inventory", "--simulate", "l4x4", "--node-name", "a").stdout
    other = dra_driver("inventory", "--simulate", "l4x4", "--node-name", "b").stdout
    assert first == again
    assert first != other


def test_inventory_lists_every_simulated_profile() -> None:
    result = dra_driver("inventory", "--list-profiles")
    assert result.returncode == 0
    listed = {line.split()[0] for line in result.stdout.splitlines()}
    assert listed == set(NODE_PROFILES)


def test_an_unknown_profile_is_a_clear_error() -> None:
    result = dra_driver("inventory", "--simulate", "dgx-z900")
    assert result.returncode == 2
    assert "dgx-z900" in result.stderr
    assert "--simulate / DRA_SIMULATE" in result.stderr
    assert "Traceback" not in result.stderr


def test_simulate_changes_what_inventory_sees(tmp_path: Path) -> None:
    common = ["--simulate", "dgx-h100", "--node-name", "n1", "--data-dir", str(tmp_path)]
    created = dra_driver(
        "simulate", "create-mig", "--gpu", "2", "--profile", "3g.40gb", "--start", "4", *common
    )
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("MIG-")
    listing = dra_driver("inventory", *common).stdout
    gpu2 = next(line for line in listing.splitlines() if line.startswith("#   gpu-2 "))
    assert "MIG on" in gpu2
    assert "3g.40gb@4" in gpu2


def test_plugin_without_node_name_says_what_to_set() -> None:
    result = dra_driver("kubelet-plugin", "--simulate", "dgx-h100")
    assert result.returncode == 2
    assert "DRA_NODE_NAME" in result.stderr


# Imported by the daemon only after its kubelet sockets are open (dra_driver.gpu_plugin.launch).
AFTER_THE_SOCKETS = [
    "kubernetes",
    "aiohttp",
    "prometheus_client",
    "pynvml",
    "dra_driver.gpu_plugin.app",
    "dra_driver.gpu_plugin.watches",
    "dra_driver.gpu_plugin.policies",
    "dra_driver.apiserver.kube",
]


def test_the_daemon_reaches_its_sockets_without_the_api_client() -> None:
    """What runs before the kubelet sockets open (the CLI, the launcher, the settings checks)
    imports neither the API client nor aiohttp nor the GPU backends: their import time would
    be start-up time the kubelet waits for (docs/performance.md)."""
    code = "import sys, dra_driver.cli, dra_driver.gpu_plugin.launch; print(*sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = set(result.stdout.split())  # a package's submodule brings the package in too
    assert [name for name in AFTER_THE_SOCKETS if name in imported] == []


def test_commands_other_than_the_daemon_run_with_the_collector_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`dra-driver` turns the cyclic garbage collector off for its imports; a long-running command
    (the webhook, the ComputeDomain controller) must not keep it off."""
    monkeypatch.setattr(sys, "argv", ["dra-driver", "inventory", "--list-profiles"])
    try:
        assert dra_driver_main() == 0
        assert gc.isenabled()
    finally:
        gc.enable()
