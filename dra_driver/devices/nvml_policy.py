"""A real GPU's compute mode and time slice, the two settings GPU sharing changes.

The compute mode is NVML's (``nvmlDeviceGetComputeMode`` / ``nvmlDeviceSetComputeMode``), what
``nvidia-smi -c`` calls. The time slice has no public NVML function: NVIDIA's DRA driver runs
``nvidia-smi compute-policy -i <uuid> --set-timeslice <0-3>`` from the driver root, and so does
this module, with the driver's ``libnvidia-ml.so.1`` preloaded as NVIDIA does. Nor can the time
slice be read, so the last value this driver set is kept in a small file of the state directory
(a GPU the driver never set is taken to have the default). nvidia-smi runs only when the time
slice changes, so a node without it still serves exclusive and MPS claims.

The order is NVIDIA's: compute mode first, then the time slice; a failed time slice puts the
compute mode back, so a failed call leaves the GPU as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pynvml
import structlog

from dra_driver.devices.backend import DeviceError
from dra_driver.devices.types import ComputeMode, ComputePolicy, TimeSlice

log = structlog.get_logger(__name__)

TIME_SLICE_FILE = "nvml-time-slices.json"
NVIDIA_SMI_DIRS = ("usr/bin", "bin", "usr/local/bin", "usr/sbin")
_NVIDIA_SMI_TIMEOUT_S = 30.0

_TO_NVML = {
    ComputeMode.DEFAULT: pynvml.NVML_COMPUTEMODE_DEFAULT,
    ComputeMode.PROHIBITED: pynvml.NVML_COMPUTEMODE_PROHIBITED,
    ComputeMode.EXCLUSIVE_PROCESS: pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
}
_FROM_NVML = {value: mode for mode, value in _TO_NVML.items()}


class NvmlComputePolicy:
    """Reads and sets compute mode and time slice of the GPUs NVML knows.

    ``driver_root`` is where ``nvidia-smi`` and ``libnvidia-ml.so.1`` are found (``/`` on a host
    install); ``library`` is the loaded NVML library's path, preloaded into nvidia-smi.
    """

    def __init__(self, driver_root: Path, library: Path | None, state_dir: Path | None) -> None:
        self._driver_root = driver_root
        self._library = library
        self._file = state_dir / TIME_SLICE_FILE if state_dir is not None else None
        self._in_memory: dict[str, str] = {}

    def read(self, handle: Any, gpu_uuid: str) -> ComputePolicy:
        try:
            mode = _FROM_NVML.get(int(pynvml.nvmlDeviceGetComputeMode(handle)), ComputeMode.DEFAULT)
        except pynvml.NVMLError as e:
            raise DeviceError(f"reading the compute mode of GPU {gpu_uuid}: {e}") from e
        return ComputePolicy(mode, TimeSlice(self._time_slices().get(gpu_uuid, TimeSlice.DEFAULT.value)))

    def set(self, handle: Any, gpu_uuid: str, policy: ComputePolicy) -> None:
        before = self.read(handle, gpu_uuid)
        if policy.compute_mode is not before.compute_mode:
            self._set_mode(handle, gpu_uuid, policy.compute_mode)
        if policy.time_slice is before.time_slice:
            return
        try:
            self._run_nvidia_smi(gpu_uuid, policy.time_slice)
        except DeviceError:
            if policy.compute_mode is not before.compute_mode:
                try:
                    self._set_mode(handle, gpu_uuid, before.compute_mode)
                except DeviceError as e:
                    log.error("compute_mode_not_restored", gpu=gpu_uuid, error=str(e))
            raise
        self._record(gpu_uuid, policy.time_slice)

    @staticmethod
    def _set_mode(handle: Any, gpu_uuid: str, mode: ComputeMode) -> None:
        try:
            pynvml.nvmlDeviceSetComputeMode(handle, _TO_NVML[mode])
        except pynvml.NVMLError_NoPermission as e:
            raise DeviceError(
                f"setting compute mode {mode.value} on GPU {gpu_uuid}: {e}; the plugin must run privileged"
            ) from e
        except pynvml.NVMLError as e:
            raise DeviceError(f"setting compute mode {mode.value} on GPU {gpu_uuid}: {e}") from e

    def nvidia_smi(self) -> Path | None:
        for directory in NVIDIA_SMI_DIRS:
            candidate = self._driver_root / directory / "nvidia-smi"
            if os.access(candidate, os.X_OK):
                return candidate
        return None

    def _run_nvidia_smi(self, gpu_uuid: str, time_slice: TimeSlice) -> None:
        binary = self.nvidia_smi()
        if binary is None:
            raise DeviceError(
                f"setting time slice {time_slice.value} on GPU {gpu_uuid}: nvidia-smi is not in the driver "
                f"root {self._driver_root} ({', '.join(NVIDIA_SMI_DIRS)}); NVML has no call for it"
            )
        env = dict(os.environ)
        if self._library is not None:
            env["LD_PRELOAD"] = ":".join(filter(None, (str(self._library), env.get("LD_PRELOAD"))))
        command = [str(binary), "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(time_slice.level)]
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise DeviceError(f"setting time slice {time_slice.value} on GPU {gpu_uuid}: {e}") from e
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip().replace("\n", " ")[:300]
            raise DeviceError(
                f"setting time slice {time_slice.value} on GPU {gpu_uuid}: nvidia-smi exited "
                f"{done.returncode}: {output}"
            )

    def _time_slices(self) -> dict[str, str]:
        if self._file is None:
            return dict(self._in_memory)
        try:
            data = json.loads(self._file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            log.warning("time_slice_record_unreadable", path=str(self._file), error=str(e))
            return {}
        valid = {s.value for s in TimeSlice}
        return {str(k): str(v) for k, v in data.items() if v in valid} if isinstance(data, dict) else {}

    def _record(self, gpu_uuid: str, time_slice: TimeSlice) -> None:
        slices = self._time_slices()
        if time_slice is TimeSlice.DEFAULT:
            slices.pop(gpu_uuid, None)
        else:
            slices[gpu_uuid] = time_slice.value
        self._in_memory = slices
        if self._file is None:
            return
        tmp = self._file.with_suffix(".tmp")
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(slices, sort_keys=True) + "\n")
            tmp.replace(self._file)
        except OSError as e:
            log.error("time_slice_record_failed", path=str(self._file), error=str(e))
