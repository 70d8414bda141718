"""The mock libnvidia-ml.so.1 itself, through pynvml: NVML's semantics the driver's tests rely on."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from tests.mock_nvml import MockNvml, MockNvmlError

ONE_SLICE = 0  # NVML_GPU_INSTANCE_PROFILE_1_SLICE, which NVIDIA's mocks also use as the profile id


@pytest.fixture(scope="session")
def mock() -> MockNvml:
    return MockNvml()


@pytest.fixture
def nvml(mock: MockNvml) -> Iterator[MockNvml]:
    """pynvml initialised on a fresh private DGX A100 with two GPUs."""
    mock.configure("dgxa100:2")
    pynvml.nvmlInit()
    yield mock
    pynvml.nvmlShutdown()


def test_ampere_keeps_the_pending_mode_until_a_reset(nvml: MockNvml) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert (
        pynvml.nvmlDeviceSetMigMode(handle, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
    )
    assert pynvml.nvmlDeviceGetMigMode(handle) == [0, 1]  # current off, pending on
    nvml.control("reset 0")
    assert pynvml.nvmlDeviceGetMigMode(handle) == [1, 1]


def test_gpu_instances_refuse_overlaps_and_need_mig_mode(nvml: MockNvml) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    placement = pynvml.c_nvmlGpuInstancePlacement_t(0, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # "If device doesn't have MIG mode enabled"
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, ONE_SLICE, ctypes.byref(placement))
    nvml.control("mig 1 1")
    gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, ONE_SLICE, ctypes.byref(placement))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, ONE_SLICE, ctypes.byref(placement))
    info = pynvml.nvmlGpuInstanceGetInfo(gpu_instance)
    assert (info.profileId, info.placement.start, info.placement.size) == (ONE_SLICE, 0, 1)
    pynvml.nvmlGpuInstanceDestroy(gpu_instance)


def test_a_lost_gpu_answers_gpu_is_lost_and_a_reset_brings_it_back(nvml: MockNvml) -> None:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    nvml.control("lose 0")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetName(handle)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(1)) == "Mock NVIDIA A100-SXM4-40GB"
    nvml.control("reset 0")
    assert pynvml.nvmlDeviceGetName(handle) == "Mock NVIDIA A100-SXM4-40GB"


def test_calls_the_mock_does_not_model_are_function_not_found(nvml: MockNvml) -> None:
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(0))


def test_an_injected_failure_hits_only_its_gpu_and_count(nvml: MockNvml) -> None:
    nvml.control("fail nvmlDeviceGetUUID 999 gpu=1 count=1")
    first, second = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    assert pynvml.nvmlDeviceGetUUID(first).startswith("GPU-")
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetUUID(second)
    assert pynvml.nvmlDeviceGetUUID(second).startswith("GPU-")


def test_an_xid_reaches_an_event_set_registered_for_its_gpu(nvml: MockNvml) -> None:
    event_set = pynvml.nvmlEventSetCreate()
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(event_set, 10)
    nvml.control("xid 1 48 2 0")
    data = pynvml.nvmlEventSetWait(event_set, 1000)
    assert (data.eventType, data.eventData, data.gpuInstanceId, data.computeInstanceId) == (
        pynvml.nvmlEventTypeXidCriticalError,
        48,
        2,
        0,
    )
    assert pynvml.nvmlDeviceGetUUID(data.device) == pynvml.nvmlDeviceGetUUID(handle)
    nvml.control("lose 1")
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlEventSetWait(event_set, 1000)
    pynvml.nvmlEventSetFree(event_set)


def test_state_in_a_directory_is_the_same_machine_for_the_next_process(
    mock: MockNvml, tmp_path: Path
) -> None:
    mock.configure("dgxh100:1", tmp_path / "hardware")
    mock.control("mig 0 1")
    gpu_instance = mock.control("create-gi 0 0 3")
    mig_uuid = mock.control(f"create-ci 0 {gpu_instance} 0")
    mock.configure("dgxa100", tmp_path / "elsewhere")  # another machine meanwhile
    mock.configure("dgxh100:1", tmp_path / "hardware")  # and this one again, as after a restart
    pynvml.nvmlInit()
    try:
        assert pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0)) == [1, 1]
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(mig_uuid)) == mig_uuid
    finally:
        pynvml.nvmlShutdown()


def test_bad_control_commands_are_refused_with_a_reason(mock: MockNvml) -> None:
    mock.configure("dgxh100:1")
    with pytest.raises(MockNvmlError, match="no GPU 3"):
        mock.control("lose 3")
    with pytest.raises(MockNvmlError, match="unknown command"):
        mock.control("explode 0")
    with pytest.raises(MockNvmlError, match="unknown mock machine"):
        mock.configure("dgx-nope")
