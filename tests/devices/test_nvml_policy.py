"""Compute mode and time slice through the NVML backend, on the mock libnvidia-ml.so.1.

The compute mode goes through NVML (nvmlDeviceSetComputeMode); the time slice through the driver
root's nvidia-smi, as NVIDIA's driver sets it -- here the mock machine's own nvidia-smi
(hack/mock-nvml/nvidia-smi), which changes the mock GPU. Each test reads the GPU's state from the
mock machine itself, not from the backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.types import ComputeMode, ComputePolicy, TimeSlice
from tests.mock_nvml import MockNvml, install_driver_root, install_procfs


@pytest.fixture(scope="module")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def machine(tmp_path: Path, mock: MockNvml, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A DGX H100 with two GPUs whose state nvidia-smi, another process, shares."""
    state = tmp_path / "mock-state"
    monkeypatch.setenv("MOCK_NVML_STATE_DIR", str(state))
    monkeypatch.setenv("MOCK_NVML_MACHINE", "dgxh100:2")
    mock.configure("dgxh100:2", state, proc_root=install_procfs(tmp_path / "proc"))
    return state


@pytest.fixture
def backend(tmp_path: Path, machine: Path) -> Iterator[NvmlBackend]:
    root = install_driver_root(tmp_path / "driver-root")
    opened = NvmlBackend(
        procfs_root=tmp_path / "proc", dev_root=root, driver_root=root, state_dir=tmp_path / "state"
    )
    yield opened
    opened.close()


def gpu(mock: MockNvml, machine: Path, index: int) -> dict[str, Any]:
    state: dict[str, Any] = mock.state(machine)["gpus"][index]
    return state


def test_the_compute_mode_is_set_through_nvml(backend: NvmlBackend, mock: MockNvml, machine: Path) -> None:
    uuid = backend.inventory().gpus[0].uuid
    backend.set_compute_policy(uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))
    assert gpu(mock, machine, 0).get("computeMode") == 3  # NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert backend.compute_policy(uuid) == ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS)
    assert gpu(mock, machine, 1).get("computeMode") is None  # the other GPU is untouched

    backend.set_compute_policy(uuid, ComputePolicy())
    assert gpu(mock, machine, 0).get("computeMode") is None


def test_the_time_slice_is_set_with_nvidia_smi_and_remembered(
    backend: NvmlBackend, mock: MockNvml, machine: Path, tmp_path: Path
) -> None:
    uuid = backend.inventory().gpus[1].uuid
    backend.set_compute_policy(uuid, ComputePolicy(time_slice=TimeSlice.LONG))
    assert gpu(mock, machine, 1).get("timeSlice") == 3
    assert backend.compute_policy(uuid) == ComputePolicy(time_slice=TimeSlice.LONG)

    restarted = NvmlBackend(
        procfs_root=tmp_path / "proc", driver_root=tmp_path / "driver-root", state_dir=tmp_path / "state"
    )
    try:  # NVML cannot read it back: the driver's own record says what it set
        assert restarted.compute_policy(uuid).time_slice is TimeSlice.LONG
    finally:
        restarted.close()

    backend.set_compute_policy(uuid, ComputePolicy())
    assert gpu(mock, machine, 1).get("timeSlice") is None


def test_a_refused_time_slice_leaves_the_compute_mode_as_it_was(
    backend: NvmlBackend, mock: MockNvml, machine: Path
) -> None:
    uuid = backend.inventory().gpus[0].uuid
    mock.control("mig 0 1", machine)
    with pytest.raises(
        DeviceError, match=r"setting time slice Short on GPU .*nvidia-smi exited 3: .*MIG mode"
    ):
        backend.set_compute_policy(uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS, TimeSlice.SHORT))
    assert gpu(mock, machine, 0).get("computeMode") is None
    assert gpu(mock, machine, 0).get("timeSlice") is None


def test_without_nvidia_smi_only_the_time_slice_is_refused(
    backend: NvmlBackend, mock: MockNvml, machine: Path, tmp_path: Path
) -> None:
    (tmp_path / "driver-root" / "usr" / "bin" / "nvidia-smi").unlink()
    uuid = backend.inventory().gpus[0].uuid
    with pytest.raises(DeviceError, match="nvidia-smi is not in the driver root"):
        backend.set_compute_policy(uuid, ComputePolicy(time_slice=TimeSlice.MEDIUM))
    backend.set_compute_policy(uuid, ComputePolicy(ComputeMode.EXCLUSIVE_PROCESS))  # MPS needs none
    assert gpu(mock, machine, 0).get("computeMode") == 3
