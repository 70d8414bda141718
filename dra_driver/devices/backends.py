"""The one switch between the real node and the simulator: which backend drives the GPUs.

Every real module that can run on a simulated node gets its hardware here: the GPU backend, the
health source that goes with it, and the host's IMEX daemon check. ``--simulate`` decides. Beside
this switch, only these import :mod:`dra_driver.simulated` (tests/test_layers.py holds the list):
the plugin's choice of MPS daemons (above this layer), the check of ``--simulate``'s node profile in
the settings, and the simulator's own commands (``simulate``, ``compute-domain-daemon``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from pathlib import Path

from dra_driver.devices.backend import Backend
from dra_driver.devices.faults import APPLICATION_XIDS
from dra_driver.devices.health import HealthSource, NvmlHealthSource
from dra_driver.devices.host_imex import HostImex, NvidiaImexCtl
from dra_driver.devices.nvml import NvmlBackend
from dra_driver.simulated.gpus import STATE_FILE_NAME, SimulatedBackend, SimulatedHostImex
from dra_driver.simulated.health import SimulatedHealthSource


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


def open_health_source(
    backend: Backend,
    *,
    ignored_xids: Collection[int] = APPLICATION_XIDS,
    poll_seconds: float = 0.5,
    clock: Callable[[], float] = time.time,
) -> HealthSource:
    """The health source that goes with ``backend``; ``poll_seconds`` is how often it looks."""
    if isinstance(backend, SimulatedBackend):
        return SimulatedHealthSource(
            backend, ignored_xids=ignored_xids, poll_seconds=poll_seconds, clock=clock
        )
    if isinstance(backend, NvmlBackend):
        return NvmlHealthSource(
            ignored_xids=ignored_xids,
            poll_seconds=poll_seconds,
            clock=clock,
            known_gpus=backend.known_gpus(),
            mig_mode_switches=backend.mig_mode_switches,
            call_timeout=backend.call_timeout,
        )
    raise TypeError(f"no health source for the backend {type(backend).__name__}")


def open_host_imex(simulate: str | None, data_dir: Path, driver_root: Path, socket: str) -> HostImex:
    """The check of the host's ``nvidia-imex`` daemon (host-managed IMEX): ``nvidia-imex-ctl`` from
    the driver root, or on a simulated node the state ``dra-driver simulate host-imex`` sets."""
    if simulate:
        return SimulatedHostImex(data_dir / STATE_FILE_NAME, socket)
    return NvidiaImexCtl(driver_root, socket)
