"""The one place that decides which backend drives the node's GPUs."""

from __future__ import annotations

from pathlib import Path

from dra_driver.devices.backend import Backend
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.simulated.gpus import SimulatedBackend


def open_backend(
    simulate: str | None,
    data_dir: Path,
    node_name: str,
    *,
    sysfs_root: Path = Path("/sys"),
    procfs_root: Path = Path("/proc"),
    dev_root: Path = Path("/"),
    driver_root: Path | None = None,
    simulated_fabric: str = "",
) -> Backend:
    """Simulated GPUs of node profile ``simulate`` (state kept in ``data_dir``), else the real ones via NVML.

    ``driver_root`` is where this process sees the NVIDIA driver, to load NVML from;
    ``simulated_fabric`` places simulated NVL72 GPUs in an NVLink clique.
    Raises DeviceError when the profile is unknown or NVML cannot start.
    """
    if simulate:
        # The simulated GPUs' sysfs tree is theirs alone: under the data dir unless a root is given.
        simulated_sysfs = None if sysfs_root == Path("/sys") else sysfs_root
        return SimulatedBackend(
            simulate, node_name, data_dir, fabric=simulated_fabric, sysfs_root=simulated_sysfs
        )
    if driver_root is not None and dev_root == Path("/") and (driver_root / "dev" / "nvidiactl").exists():
        # A driver container that creates the device nodes in its own root (as NVIDIA's toolkit
        # decides its "dev root": the driver root when it holds /dev/nvidiactl, else /).
        dev_root = driver_root
    return NvmlBackend(
        sysfs_root=sysfs_root,
        procfs_root=procfs_root,
        dev_root=dev_root,
        driver_root=driver_root,
        state_dir=data_dir,
    )
