"""The mock libnvidia-ml.so.1 (hack/mock-nvml): where it is, a driver root that holds it, and its controls.

The library answers NVML's real C interface for a simulated machine built from NVIDIA's
go-nvml GPU mocks, so the NVML backend runs on it through pynvml exactly as on a host.
Tests reach past NVML to the "hardware" through two extra C functions of the same library
(``mockNvmlConfigure`` and ``mockNvmlControl``, see hack/mock-nvml/control.go): inject an Xid,
lose a GPU, make a call fail or hang, create MIG instances as an administrator would.

In one process there is one loaded library, shared with pynvml; ``configure`` gives each test
a fresh machine. A driver running in another process shares a machine through a state
directory (``MOCK_NVML_STATE_DIR``), and :meth:`MockNvml.control` can target that directory.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from dra_driver.devices.types import Inventory
from dra_driver.simulated.sysfs import SimulatedKernel, gpu_tree

REPO = Path(__file__).resolve().parents[1]
NVML_SONAME = "libnvidia-ml.so.1"
LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"  # where a Debian/Ubuntu host keeps the driver's libraries

# nvmlReturn_t values the tests inject.
NVML_ERROR_UNKNOWN = 999
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23


@functools.cache
def mock_nvml_library() -> Path:
    """The built library; hack/build-mock-nvml.sh builds it first when it is missing or stale."""
    out = subprocess.run(
        [str(REPO / "hack" / "build-mock-nvml.sh")], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        if line.startswith("MOCK_NVML_LIB="):
            return Path(line.partition("=")[2])
    raise RuntimeError(f"hack/build-mock-nvml.sh printed no MOCK_NVML_LIB line: {out!r}")


def install_driver_root(root: Path) -> Path:
    """Lay out ``root`` as a host's driver root: the library at its usual place, /dev/nvidiactl."""
    lib_dir = root / LIBRARY_DIR
    lib_dir.mkdir(parents=True, exist_ok=True)
    link = lib_dir / NVML_SONAME
    if not link.exists():
        link.symlink_to(mock_nvml_library())
    smi = root / "usr" / "bin" / "nvidia-smi"  # the mock's own: `compute-policy --set-timeslice` only
    if not smi.exists():
        smi.parent.mkdir(parents=True, exist_ok=True)
        smi.symlink_to(REPO / "hack" / "mock-nvml" / "nvidia-smi")
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for name, stand_in in (
        ("nvidiactl", "/dev/null"),
        ("nvidia-uvm", "/dev/zero"),
        ("nvidia-uvm-tools", "/dev/full"),
    ):
        if not (dev / name).exists():
            (dev / name).symlink_to(stand_in)
    return root


CAPS_MAJOR = 236


def install_procfs(procfs: Path) -> Path:
    """The kernel driver's /proc/devices (nvidia-caps major); the mock writes the capability files."""
    procfs.mkdir(parents=True, exist_ok=True)
    (procfs / "devices").write_text(
        f"Character devices:\n  1 mem\n195 nvidia-frontend\n{CAPS_MAJOR} nvidia-caps\n510 nvidia-uvm\n\n"
        "Block devices:\n  8 sd\n"
    )
    return procfs


class MockNvmlError(RuntimeError):
    pass


class MockNvml:
    """The control interface of the loaded mock library."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL(str(mock_nvml_library()), mode=ctypes.RTLD_GLOBAL)
        self._lib.mockNvmlConfigure.argtypes = [ctypes.c_char_p] * 4
        self._lib.mockNvmlControl.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_uint,
        ]

    def configure(
        self,
        machine: str = "",
        state_dir: Path | None = None,
        proc_root: Path | None = None,
        sysfs_root: Path | None = None,
    ) -> None:
        """A fresh machine for this process (e.g. ``dgxh100:2``: a DGX H100 with its first two GPUs).

        ``sysfs_root``: the node's sysfs tree (:func:`install_gpu_tree`), where a GPU bound off
        nvidia is gone from NVML's view, as on a host.
        """
        status = self._lib.mockNvmlConfigure(
            machine.encode(),
            str(state_dir or "").encode(),
            str(proc_root or "").encode(),
            str(sysfs_root or "").encode(),
        )
        if status != 0:
            raise MockNvmlError(f"unknown mock machine {machine!r}")

    def control(self, command: str, state_dir: Path | None = None) -> str:
        reply = ctypes.create_string_buffer(1 << 20)
        status = self._lib.mockNvmlControl(str(state_dir or "").encode(), command.encode(), reply, len(reply))
        text = reply.value.decode()
        if status != 0:
            raise MockNvmlError(f"mock NVML: {command}: {text}")
        return text

    def state(self, state_dir: Path | None = None) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.control("state", state_dir))
        return result


def mock_environment(
    state_dir: Path, machine: str = "dgxh100", proc_root: Path | None = None
) -> dict[str, str]:
    """The environment that makes a driver process in another process share ``state_dir``'s machine."""
    env = {"MOCK_NVML_MACHINE": machine, "MOCK_NVML_STATE_DIR": str(state_dir)}
    if proc_root is not None:
        env["MOCK_NVML_PROC_ROOT"] = str(proc_root)
    return {**os.environ, **env}


def install_sysfs(sysfs: Path, gpus: list[tuple[str, str, str | None, int]]) -> Path:
    """A host's PCI tree in sysfs for GPUs given as (bus id, PCIe root, switch or None, NUMA node).

    Each GPU's directory lies under its host bridge and root port (and, behind a switch, under the
    switch's upstream port and one downstream port), ``bus/pci/devices/<bus id>`` links to it and
    its ``numa_node`` holds the node, as the kernel lays them out.
    """
    devices = sysfs / "devices"
    links = sysfs / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    for index, (bus_id, root, switch, numa_node) in enumerate(gpus):
        domain, root_bus = root.removeprefix("pci").split(":")
        path = devices / root / f"{domain}:{root_bus}:01.0"
        if switch is not None:
            switch_bus = int(switch.split(":")[1], 16)
            path = path / switch / f"{domain}:{switch_bus + 1:02x}:{index % 32:02x}.0"
        path = path / bus_id
        path.mkdir(parents=True, exist_ok=True)
        (path / "numa_node").write_text(f"{numa_node}\n")
        (links / bus_id).symlink_to(os.path.relpath(path, links))
    return sysfs


def install_gpu_tree(sysfs: Path, inventory: Inventory) -> SimulatedKernel:
    """The sysfs tree passthrough works on for the mock's GPUs, as the simulator builds its own.

    Each GPU of ``inventory`` (read through NVML before the tree exists) on nvidia, alone in its
    IOMMU group, with BARs sized from its memory (:func:`dra_driver.simulated.sysfs.gpu_tree`).
    Returns the stand-in for the kernel that acts on the driver's writes into the tree: an
    :class:`~dra_driver.devices.nvml.NvmlBackend` made with ``pci_write=kernel.write`` binds
    there, and a mock configured with ``sysfs_root`` stops listing a GPU the tree has off nvidia.
    """
    gpu_tree(sysfs, inventory.gpus)
    return SimulatedKernel(sysfs)
