"""A sysfs tree for simulated GPUs, and a stand-in for the kernel that acts on writes to it.

The tree has the files :mod:`dra_driver.devices.pci` reads and writes on a node: per GPU its
``bus/pci/devices/<address>`` directory with the ``driver`` and ``iommu_group`` links,
``driver_override`` and ``resource`` (its memory BARs, sized as a GPU of its memory has them);
the ``nvidia`` and ``vfio-pci`` drivers with their ``bind`` and ``unbind`` files; one IOMMU group
per GPU; ``class/misc/vfio/dev``. Links are relative, so a tree can be copied or mounted elsewhere.
:func:`gpu_tree` builds it for any GPUs: the simulator's, and in the tests the mock NVML's
(``tests/mock_nvml.py``), whose library hides a GPU the tree has off nvidia, as NVML does.

On a node the kernel reacts to a write into ``bind``: it probes the driver, creates the
``driver`` link, and for vfio-pci ``/dev/vfio/<group>`` and the ``vfio-dev`` cdev. Here
:class:`SimulatedKernel` does that after writing the file, with the kernel's refusals
(binding a bound device: EBUSY; vfio-pci without the override: ENODEV; unbinding from a
driver the device is not bound to: ENODEV). It can be told to fail a step, which is how the
tests show that every failed step rolls back (:meth:`SimulatedKernel.fail`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from dra_driver.devices.pci import NVIDIA, VFIO_PCI
from dra_driver.devices.types import Gpu

VFIO_MISC = (10, 196)  # /dev/vfio/vfio, a misc device
VFIO_GROUP_MAJOR = 243  # dynamic on a node; read from class/vfio/<group>/dev, never assumed
VFIO_CDEV_MAJOR = 506
FIRST_GROUP = 20  # group numbers as a server has them: the GPUs' come after the chipset's

# A line of sysfs's ``resource`` file per BAR, ROM and SR-IOV BAR ("start end flags"; zeros: unused).
_RESOURCE_LINES = 13
_MEM_32 = 0x40200  # IORESOURCE_MEM | IORESOURCE_SIZEALIGN; the BAR's own type bits (low 4) 0: 32-bit
_MEM_64_PREFETCH = 0x14220C  # ... | IORESOURCE_PREFETCH | IORESOURCE_MEM_64; type bits 64-bit, prefetch
_REGISTERS = 16 << 20  # BAR0, the GPU's registers
_BAR3 = 32 << 20  # BAR3, a 64-bit window beside the framebuffer's


def build_tree(root: Path, gpus: Iterable[tuple[str, int]], device_id: int = 0x2330) -> None:
    """Create the tree for ``gpus`` (PCI address, IOMMU group) of PCI device ``device_id``, each bound
    to nvidia (more with :func:`add_function`); keeps an existing one.

    A tree that exists is the state of a running node (a GPU may be on vfio-pci): it is left
    as it is, as a reboot is the only thing that resets a node's bindings.
    """
    for driver in (NVIDIA, VFIO_PCI):
        directory = root / "bus" / "pci" / "drivers" / driver
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("bind", "unbind"):
            (directory / name).touch()
    misc = root / "class" / "misc" / "vfio"
    misc.mkdir(parents=True, exist_ok=True)
    (misc / "dev").write_text(f"{VFIO_MISC[0]}:{VFIO_MISC[1]}\n")
    for address, group in gpus:
        add_function(root, address, group, NVIDIA, device_id=device_id)


def gpu_tree(root: Path, gpus: Iterable[Gpu]) -> None:
    """The tree of a node with ``gpus``, each on nvidia in IOMMU group ``FIRST_GROUP`` + its index."""
    build_tree(root, ())
    for gpu in gpus:
        add_function(
            root,
            gpu.pci_bus_id,
            FIRST_GROUP + gpu.index,
            NVIDIA,
            device_id=gpu.pci_device_id,
            memory_bytes=gpu.memory_bytes,
        )


def gpu_resources(bus: int, memory_bytes: int) -> str:
    """sysfs's ``resource`` of a GPU on PCI bus ``bus`` with ``memory_bytes`` of memory.

    BAR0 (registers, 32-bit), BAR1 (the framebuffer's window: the memory rounded up to a power of
    two, 64-bit prefetchable; the next BAR is its upper half) and BAR3 (64-bit), as an H100's
    ``lspci -v`` shows them (16M, 128G, 32M).
    """
    bar1 = 1 << max(memory_bytes - 1, 0).bit_length()
    window = (bus + 1) << 40  # a window of its own, aligned to any BAR1 up to 1 TiB
    bars = {
        0: (0x8000_0000 + (bus % 0x70) * _REGISTERS, _REGISTERS, _MEM_32),
        1: (window, bar1, _MEM_64_PREFETCH),
        3: (window + bar1, _BAR3, _MEM_64_PREFETCH),
    }
    lines = []
    for line in range(_RESOURCE_LINES):
        start, size, flags = bars.get(line, (0, 0, 0))
        end = start + size - 1 if size else 0
        lines.append(f"0x{start:016x} 0x{end:016x} 0x{flags:016x}")
    return "\n".join(lines) + "\n"


def add_function(
    root: Path,
    address: str,
    group: int,
    driver: str | None,
    *,
    vendor: int = 0x10DE,
    device_id: int = 0x2330,
    pci_class: int = 0x030200,
    memory_bytes: int | None = None,
) -> None:
    """Add a PCI function to ``group``, bound to ``driver`` (also a GPU's companion, e.g. its audio).

    ``memory_bytes``: a GPU's memory, which sizes its BARs (:func:`gpu_resources`); None: no
    ``resource`` file.
    """
    device = root / "bus" / "pci" / "devices" / address
    if device.is_dir():
        return
    device.mkdir(parents=True)
    (device / "driver_override").write_text("(null)\n")
    (device / "vendor").write_text(f"0x{vendor:04x}\n")
    (device / "device").write_text(f"0x{device_id:04x}\n")
    (device / "class").write_text(f"0x{pci_class:06x}\n")
    if memory_bytes is not None:
        (device / "resource").write_text(gpu_resources(int(address.split(":")[1], 16), memory_bytes))
    members = root / "kernel" / "iommu_groups" / str(group) / "devices"
    members.mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../../../kernel/iommu_groups/{group}", device / "iommu_group")
    os.symlink(f"../../../../bus/pci/devices/{address}", members / address)
    if driver is not None:
        drivers = root / "bus" / "pci" / "drivers" / driver
        for name in ("bind", "unbind"):
            (drivers / name).parent.mkdir(parents=True, exist_ok=True)
            (drivers / name).touch()
        os.symlink(f"../../drivers/{driver}", device / "driver")


class SimulatedKernel:
    """Writes a sysfs file under ``root`` and does what the kernel would do on that write."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._faults: dict[str, int] = {}
        self.steps: list[tuple[str, str]] = []  # (file written, text): what the driver did, in order

    def fail(self, step: str, error: int = errno.EIO) -> None:
        """Make the next write of ``step`` ("unbind", "driver_override", "bind") fail with ``error``."""
        self._faults[step] = error

    def write(self, path: Path, text: str) -> None:
        relative = path.relative_to(self.root)
        step = relative.name
        if step in self._faults:
            code = self._faults.pop(step)
            raise OSError(code, os.strerror(code))
        self.steps.append((str(relative), text))
        if step == "driver_override":
            path.write_text((text.strip() or "(null)") + "\n")
            return
        address = text.strip()
        device = self.root / "bus" / "pci" / "devices" / address
        if not device.is_dir():
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        # devices/<address>/driver/unbind resolves to drivers/<driver>/unbind, as on a node.
        driver = path.resolve().parent.name
        if step == "unbind":
            self._unbind(device, driver)
        elif step == "bind":
            self._bind(device, address, driver)
        else:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    def _unbind(self, device: Path, driver: str) -> None:
        link = device / "driver"
        if not link.is_symlink() or Path(os.readlink(link)).name != driver:
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        link.unlink()
        for cdev in (device / "vfio-dev").glob("vfio*") if (device / "vfio-dev").is_dir() else ():
            (cdev / "dev").unlink()
            cdev.rmdir()
        group = Path(os.readlink(device / "iommu_group")).name
        if driver == VFIO_PCI and not self._group_on_vfio(group):
            node = self.root / "class" / "vfio" / group
            (node / "dev").unlink()
            node.rmdir()

    def _bind(self, device: Path, address: str, driver: str) -> None:
        if (device / "driver").is_symlink():
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
        override = (device / "driver_override").read_text().strip()
        # vfio-pci has no device table: it takes a device only through the override.
        if override not in ("(null)", driver) or (driver == VFIO_PCI and override != VFIO_PCI):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        os.symlink(f"../../drivers/{driver}", device / "driver")
        if driver != VFIO_PCI:
            return
        group = Path(os.readlink(device / "iommu_group")).name
        node = self.root / "class" / "vfio" / group
        node.mkdir(parents=True, exist_ok=True)
        (node / "dev").write_text(f"{VFIO_GROUP_MAJOR}:{group}\n")
        index = sorted((self.root / "bus" / "pci" / "devices").iterdir()).index(device)
        cdev = device / "vfio-dev" / f"vfio{index}"
        cdev.mkdir(parents=True, exist_ok=True)
        (cdev / "dev").write_text(f"{VFIO_CDEV_MAJOR}:{index}\n")

    def _group_on_vfio(self, group: str) -> bool:
        members = self.root / "kernel" / "iommu_groups" / group / "devices"
        return any(
            (member / "driver").is_symlink() and Path(os.readlink(member / "driver")).name == VFIO_PCI
            for member in members.iterdir()
        )
