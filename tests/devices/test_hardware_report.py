"""hack/hardware-inventory.sh: the read-only report of a GPU host, on the mock libnvidia-ml, and the
comparison of every golden file of real hardware (tests/devices/golden/) with the catalog.

The script runs in its own process, as on a GPU host, and shares the mock machine through its state
directory; the test sets the machine up through the mock's control interface (an administrator's MIG
device, a GPU instance without a compute instance, a pending MIG mode) and checks the JSON against it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

from dra_driver.hardware_report.report import catalog_differences, report
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.nodes import NODE_PROFILES
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs, mock_environment

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hack" / "hardware-inventory.sh"
GOLDEN = Path(__file__).resolve().parent / "golden"
ONE_G, THREE_G = 0, 2  # H100 GPU-instance profile ids as NVIDIA's mock reports them


def _run_report(
    tmp_path: Path, machine: str, setup: list[str], then: Callable[[], None] | None = None
) -> tuple[dict[str, Any], MockNvml, Path]:
    """The machine after ``setup`` (mock control commands) and ``then``, and the script's report of it."""
    root = install_driver_root(tmp_path / "driver-root")
    procfs = install_procfs(tmp_path / "proc")
    hardware = tmp_path / "hardware"
    mock = MockNvml()
    mock.configure(machine, hardware, proc_root=procfs)
    for command in setup:
        mock.control(command, hardware)
    if then is not None:
        then()
    before = mock.state(hardware)
    out = tmp_path / "report.json"
    roots = ["--driver-root", str(root), "--procfs-root", str(procfs), "--sysfs-root", str(tmp_path / "sys")]
    done = subprocess.run(
        [str(SCRIPT), *roots, "-o", str(out)],
        env=mock_environment(hardware, machine, procfs),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert mock.state(hardware) == before  # read-only: the machine is exactly as it was
    result: dict[str, Any] = json.loads(out.read_text())
    return result, mock, hardware


def _switch_mig_mode_on_through_nvml() -> None:
    """What `nvidia-smi -i 0 -mig 1` does: on Ampere the new mode waits for a GPU reset."""
    pynvml.nvmlInit()
    try:
        status = pynvml.nvmlDeviceSetMigMode(
            pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.NVML_DEVICE_MIG_ENABLE
        )
        assert status == pynvml.NVML_ERROR_RESET_REQUIRED
    finally:
        pynvml.nvmlShutdown()


def test_the_hardware_report_describes_the_mock_machine_and_changes_nothing(tmp_path: Path) -> None:
    setup = ["mig 1 1", f"create-gi 1 {THREE_G} 0", f"create-gi 1 {ONE_G} 6"]
    data, mock, hardware = _run_report(tmp_path, "dgxh100:2", setup)
    state = mock.state(hardware)
    assert (data["schemaVersion"], data["source"], data["readOnly"]) == (1, "nvml", True)
    assert data["versions"] | {"nvidiaMlPy": None} == {
        "driver": "550.54.15",
        "cudaDriver": "12.4",
        "nvml": "12.550.54.15",
        "nvidiaMlPy": None,
    }
    first, second = data["gpus"]
    assert [g["uuid"] for g in data["gpus"]] == [g["uuid"] for g in state["gpus"]]
    assert (first["productName"], first["pciDeviceId"], first["memoryTotalMiB"]) == (
        "NVIDIA H100 80GB HBM3",
        "0x2330",
        81920,
    )
    # Every NVLink leads to the baseboard's NVSwitches, which the two GPUs share.
    assert first["nvlinkRemotes"] == second["nvlinkRemotes"] == [f"0000:0{bus}:00.0" for bus in (5, 6, 7, 8)]
    assert (first["migMode"], second["migMode"]) == (
        {"current": "disabled", "pending": "disabled"},
        {"current": "enabled", "pending": "enabled"},
    )
    profiles = {p["name"]: p for p in first["migProfiles"]}
    assert sorted(profiles) == sorted(
        ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    )
    assert profiles["3g.40gb"]["placements"] == [{"start": 0, "size": 3}, {"start": 4, "size": 3}]
    assert (profiles["3g.40gb"]["profileId"], profiles["3g.40gb"]["nvmlName"]) == (THREE_G, "MIG 3g.40gb")
    # The GPU instances had no compute instance when the report was made: reserved, no MIG device.
    assert (second["migDevices"], second["reservedPlacements"]) == (
        [],
        [{"profile": "1g.10gb", "start": 6, "size": 1}, {"profile": "3g.40gb", "start": 0, "size": 3}],
    )
    published = {d["name"] for d in data["publishedDevices"]}
    assert {"gpu-0", f"gpu-0-mig-3g40gb-{THREE_G}-4"} <= published
    assert "gpu-1" not in published  # in MIG mode the full GPU is not offered
    assert "gpu-1-mig-2g20gb-1-4" in published  # free slices of the MIG GPU
    assert {f"gpu-1-mig-1g10gb-{ONE_G}-{start}" for start in range(7)} & published == {
        f"gpu-1-mig-1g10gb-{ONE_G}-{start}" for start in (3, 4, 5)
    }  # none overlapping a GPU instance


def test_the_hardware_report_lists_mig_devices_and_a_pending_mig_mode(tmp_path: Path) -> None:
    gi_setup = ["mig 0 1", f"create-gi 0 {THREE_G} 4"]
    data, _mock, _hardware = _run_report(tmp_path / "h100", "dgxh100:1", [*gi_setup, "create-ci 0 1 2"])
    (mig,) = data["gpus"][0]["migDevices"]
    assert (mig["profile"], mig["profileId"], mig["placement"]) == (
        "3g.40gb",
        THREE_G,
        {"start": 4, "size": 3},
    )
    assert mig["uuid"].startswith("MIG-")
    (published,) = [d for d in data["publishedDevices"] if d["name"] == f"gpu-0-mig-3g40gb-{THREE_G}-4"]
    assert published["attributes"]["uuid"] == {"string": mig["uuid"]}
    # On Ampere, switching MIG mode needs a reset: the administrator's switch is only pending.
    ampere, _mock, _hardware = _run_report(
        tmp_path / "a100", "dgxa100:1", [], _switch_mig_mode_on_through_nvml
    )
    assert ampere["gpus"][0]["migMode"] == {"current": "disabled", "pending": "enabled"}
    assert ampere["gpus"][0]["migModeChangeRequiresReset"] is True


def test_without_nvml_in_the_driver_root_the_report_says_so_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run(
        [str(SCRIPT), "--driver-root", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: hardware report: NVML not available")
    assert f"is not under driver root {tmp_path}" in line
    assert "Traceback" not in done.stderr


# --- the catalog comparison ------------------------------------------------------------------------


@pytest.mark.parametrize("profile", sorted(NODE_PROFILES))
def test_a_report_of_the_catalogs_own_gpus_differs_from_the_catalog_nowhere(
    profile: str, tmp_path: Path
) -> None:
    backend = SimulatedBackend(profile, "node-a", tmp_path)
    data = report(backend, backend.inventory())
    assert [d for gpu in data["gpus"] for d in catalog_differences(gpu)] == []


def test_the_comparison_finds_where_nvidias_mock_and_the_catalog_differ(tmp_path: Path) -> None:
    data, _mock, _hardware = _run_report(tmp_path, "dgxh100:1", [])
    found = set(catalog_differences(data["gpus"][0]))
    where = "NVIDIA H100 80GB HBM3 vs catalog h100-sxm5-80gb"
    # The differences docs/mock-nvml.md lists ("Where NVIDIA's mocks and the hardware differ").
    assert {
        f"{where}: memoryTotalMiB: hardware 81920, catalog 81559",
        f"{where}: memorySlices: hardware 7, catalog 8",
        f"{where}: profile 1g.10gb: profileId: hardware 0, catalog 19",
        f"{where}: profile 7g.80gb: multiprocessorCount: hardware 112, catalog 132",
        f"{where}: profile 3g.40gb: placements: hardware [{{'start': 0, 'size': 3}}, "
        "{'start': 4, 'size': 3}], catalog [{'start': 0, 'size': 4}, {'start': 4, 'size': 4}]",
    } <= found
    assert not [d for d in found if "formula" in d or "only in the" in d]  # same profiles, same names


def test_an_unknown_gpu_is_a_difference_not_a_crash() -> None:
    gpu = {"productName": "NVIDIA Z9000", "pciDeviceId": "0x9999"}
    assert catalog_differences(gpu) == ["NVIDIA Z9000 (0x9999): no single catalog entry has this GPU"]


_GOLDEN_FILES = sorted(GOLDEN.glob("*.json"))
_NO_GOLDEN_FILE = pytest.param(
    None, id="none", marks=pytest.mark.skip(reason="no hardware golden file yet (golden/README.md)")
)


@pytest.mark.parametrize(
    "golden", [pytest.param(path, id=path.stem) for path in _GOLDEN_FILES] or [_NO_GOLDEN_FILE]
)
def test_a_golden_file_of_real_hardware_matches_the_catalog(golden: Path) -> None:
    """Reports kept from real GPU hosts (hack/hardware-inventory.sh -o tests/devices/golden/X.json).

    Until a GPU host has been lent there is none, and the run shows that as a skip with its reason.
    """
    data = json.loads(golden.read_text())
    assert (data["schemaVersion"], data["source"]) == (1, "nvml"), golden.name
    assert data["gpus"], f"{golden.name} lists no GPU"
    assert [d for gpu in data["gpus"] for d in catalog_differences(gpu)] == [], golden.name
