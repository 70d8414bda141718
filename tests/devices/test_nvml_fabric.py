"""NVLink fabric info and the memory addressing mode, on NVML's C interface (the mock library).

A GB200 NVL72 compute tray (``MOCK_NVML_MACHINE=gb200nvl72``) registers its GPUs with the
fabric manager in one cluster and clique; a DGX H100 registers them with no cluster (single-node
NVSwitch); an A100 has no fabric info at all. The backend turns what NVML reports into the node's
clique exactly as NVIDIA's compute-domain plugin does.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.devices.fabric import node_clique
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import FabricInfo, FabricState
from tests.mock_nvml import (
    MockNvml,
    install_driver_root,
    install_procfs,
    mock_environment,
    mock_nvml_library,
)

REPO = Path(__file__).resolve().parents[2]
RACK = "3f1d1c52-8d0e-4b6e-9a51-0c1b2a3d4e5f"
# The simulator's default NVLink domain, which the mock's trays join unless told otherwise.
DEFAULT_CLUSTER = "76c7d4f7-82be-58c7-9c42-0480cc88c498"


@pytest.fixture(scope="session")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def open_backend(tmp_path: Path, mock: MockNvml) -> Iterator[Callable[[str], NvmlBackend]]:
    """An NVML backend on a fresh mock machine of this process, loaded from a driver root."""
    opened: list[NvmlBackend] = []

    def make(machine: str) -> NvmlBackend:
        root = install_driver_root(tmp_path / "driver-root")
        procfs = install_procfs(tmp_path / "proc")
        mock.configure(machine, proc_root=procfs)
        backend = NvmlBackend(
            sysfs_root=tmp_path / "sys", procfs_root=procfs, dev_root=root, driver_root=root
        )
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        backend.close()


# --- the library ---------------------------------------------------------------------------------


@pytest.fixture
def nvml(mock: MockNvml) -> Iterator[Callable[[str], MockNvml]]:
    started = []

    def start(machine: str) -> MockNvml:
        mock.configure(machine)
        pynvml.nvmlInit()
        started.append(machine)
        return mock

    yield start
    for _ in started:
        pynvml.nvmlShutdown()


def test_a_tray_reports_its_cluster_and_clique_in_every_struct_version(
    nvml: Callable[[str], MockNvml],
) -> None:
    nvml("gb200nvl72").control(f"fabric all cluster={RACK} clique=7")
    handle = pynvml.nvmlDeviceGetHandleByIndex(3)
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA GB200"
    v1 = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(v1))
    v3 = pynvml.c_nvmlGpuFabricInfo_v3_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(v3))
    for info in (v1, v3):
        assert bytes(info.clusterUuid).hex() == RACK.replace("-", "")
        assert (info.cliqueId, info.state, info.status) == (7, pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, 0)
    assert v3.healthSummary == 1  # NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
    assert pynvml.nvmlDeviceGetAddressingMode(handle) == pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS


def test_a_versioned_struct_of_an_unknown_version_is_refused(nvml: Callable[[str], MockNvml]) -> None:
    nvml("gb200nvl72")
    info = pynvml.c_nvmlGpuFabricInfo_v3_t()
    info.version = 0x05000028
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetGpuFabricInfoV(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))


def test_ampere_has_no_fabric_info_and_x86_no_addressing_mode(nvml: Callable[[str], MockNvml]) -> None:
    nvml("dgxa100:1")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(pynvml.c_nvmlGpuFabricInfo_t()))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetAddressingMode(handle)


# --- the backend ----------------------------------------------------------------------------------


def test_a_trays_gpus_share_the_clique_nvidia_names(open_backend: Callable[[str], NvmlBackend]) -> None:
    inventory = open_backend("gb200nvl72").inventory()
    assert len(inventory.gpus) == 4
    assert {gpu.fabric for gpu in inventory.gpus} == {
        FabricInfo(DEFAULT_CLUSTER, 1, FabricState.COMPLETED, "Success")
    }
    assert node_clique(inventory).clique == f"{DEFAULT_CLUSTER}.1"
    assert {gpu.addressing_mode for gpu in inventory.gpus} == {"ATS"}


def test_single_node_nvswitch_registers_in_no_cluster_and_joins_no_clique(
    open_backend: Callable[[str], NvmlBackend], mock: MockNvml
) -> None:
    inventory = open_backend("dgxh100:2").inventory()
    info = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(pynvml.nvmlDeviceGetHandleByIndex(0), ctypes.byref(info))
    assert info.state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED
    assert not any(info.clusterUuid)
    # An all-zero cluster is no NVLink domain: without this the node would claim clique "0000...0.0".
    assert [gpu.fabric for gpu in inventory.gpus] == [None, None]
    assert node_clique(inventory).reason.startswith("GPUs without NVLink fabric info")
    assert {gpu.addressing_mode for gpu in inventory.gpus} == {None}


def test_a_gpu_still_registering_keeps_the_tray_out(
    open_backend: Callable[[str], NvmlBackend], mock: MockNvml
) -> None:
    backend = open_backend("gb200nvl72")
    mock.control("fabric 2 state=in-progress")
    clique = node_clique(backend.inventory())
    assert clique.clique == ""
    assert "fabric registration has not completed" in clique.reason
    assert "(InProgress)" in clique.reason


def test_a_registration_that_completed_with_an_error_keeps_the_tray_out(
    open_backend: Callable[[str], NvmlBackend], mock: MockNvml
) -> None:
    backend = open_backend("gb200nvl72")
    mock.control("fabric 1 status=999")  # NVML_ERROR_UNKNOWN, reported as "Unknown Error"
    inventory = backend.inventory()
    assert inventory.gpus[1].fabric is not None
    assert inventory.gpus[1].fabric.status == "Unknown Error"
    assert node_clique(inventory).reason.endswith(f"{inventory.gpus[1].uuid} (Unknown Error)")


def test_a_failing_fabric_read_leaves_the_gpu_out_with_the_others_published(
    open_backend: Callable[[str], NvmlBackend], mock: MockNvml
) -> None:
    backend = open_backend("gb200nvl72")
    mock.control("fail nvmlDeviceGetGpuFabricInfo 999 gpu=0")
    assert [gpu.index for gpu in backend.inventory().gpus] == [1, 2, 3]


def test_trays_in_their_own_processes_are_in_the_cliques_their_environment_names(tmp_path: Path) -> None:
    """Several mock nodes, one state directory each: two in clique 1, one in clique 2 of one rack."""
    root = install_driver_root(tmp_path / "driver-root")
    code = (
        "import json, sys; from pathlib import Path; from dra_driver.devices.nvml import NvmlBackend; "
        "from dra_driver.devices.fabric import node_clique; "
        "b = NvmlBackend(driver_root=Path(sys.argv[1]), dev_root=Path(sys.argv[1])); "
        "print(json.dumps(node_clique(b.inventory()).clique))"
    )
    cliques = []
    for node, fabric in (("a", f"{RACK}/1"), ("b", f"{RACK}/1"), ("c", f"{RACK}/2")):
        env = mock_environment(tmp_path / node, machine="gb200nvl72") | {"MOCK_NVML_FABRIC": fabric}
        env.pop("LD_LIBRARY_PATH", None)
        done = subprocess.run(
            [sys.executable, "-c", code, str(root)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        cliques.append(json.loads(done.stdout.splitlines()[-1]))
    assert cliques == [f"{RACK}.1", f"{RACK}.1", f"{RACK}.2"]


def test_a_malformed_fabric_setting_fails_nvml_init_with_the_reason_on_stderr(tmp_path: Path) -> None:
    env = {**os.environ, "MOCK_NVML_MACHINE": "gb200nvl72", "MOCK_NVML_FABRIC": "rack-one/1"}
    env["LD_LIBRARY_PATH"] = str(mock_nvml_library().parent)
    done = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert 'MOCK_NVML_FABRIC: fabric "rack-one/1": "rack-one" is not a UUID' in done.stderr
