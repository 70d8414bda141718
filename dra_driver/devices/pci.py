"""GPUs on the PCI bus as sysfs shows them, and the steps that hand one to ``vfio-pci`` and back.

Passthrough (a GPU given whole to a virtual machine) needs the GPU bound to the kernel's
``vfio-pci`` driver instead of ``nvidia``; the VM's process then opens its IOMMU group's
``/dev/vfio/<group>``. Everything here is read from and written to sysfs under ``root``
(``/sys`` on a node; the simulator builds the same tree elsewhere, :mod:`dra_driver.simulated.sysfs`)::

    bus/pci/devices/<address>/vendor, class     "0x10de", "0x030200": which functions are NVIDIA GPUs
    bus/pci/devices/<address>/driver            -> the bound driver's directory (absent: unbound)
    bus/pci/devices/<address>/iommu_group       -> kernel/iommu_groups/<group>
    bus/pci/devices/<address>/driver_override   the driver the next probe must pick, "(null)": any
    bus/pci/devices/<address>/vfio-dev/vfio<N>  the IOMMUFD cdev, while bound to vfio-pci
    bus/pci/devices/<address>/resource          "start end flags" per BAR: what a VM must map
    bus/pci/drivers/<driver>/bind, unbind       write an address: bind or unbind that device
    kernel/iommu_groups/<group>/devices/*       every function in the group
    class/vfio/<group>/dev, class/misc/vfio/dev "major:minor" of /dev/vfio/<group>, /dev/vfio/vfio
    class/misc/iommu                            present where the kernel has IOMMUFD (/dev/iommu)

A GPU's passthrough device is named by its place among the node's NVIDIA GPUs in PCI address
order, ``gpu-vfio-<index>``, as NVIDIA's driver names it (go-nvlib's ``nvpci``): the order
counts every GPU function on the bus, so a GPU on vfio-pci, which NVML no longer lists, keeps
its index and moves none of the others'.

A move from one driver to another is three writes (unbind, driver_override, bind) and a check
that the device is now bound where it should be. A failed move to ``vfio-pci`` rolls back to
``nvidia`` at once, so that a GPU is never left unbound by a failed prepare (NVIDIA's driver
left it so: its issue #1255). ``write`` is the one way this module changes sysfs: on a node a
plain file write, which the kernel acts on; the simulator passes its stand-in for the kernel.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NVIDIA = "nvidia"
VFIO_PCI = "vfio-pci"
# Drivers whose functions may share an IOMMU group with a passed-through GPU: the group's bridges
# (pcieport) stay with the host, and a function already on vfio-pci belongs to no host driver.
_HARMLESS_DRIVERS = frozenset({VFIO_PCI, "pcieport"})

_BARS = 6  # the lines of sysfs's resource file that are BARs; then the ROM and SR-IOV's
_BAR_TYPE_MASK = 0x6  # PCI_BASE_ADDRESS_MEM_TYPE_MASK, kept in the resource's flags
_BAR_TYPE_64 = 0x4  # PCI_BASE_ADDRESS_MEM_TYPE_64

NVIDIA_VENDOR = "0x10de"
# PCI classes of a GPU: VGA controller (0x0300) and 3D controller (0x0302), as nvpci reads them.
_GPU_CLASSES = ("0x0300", "0x0302")

Write = Callable[[Path, str], None]


class PciError(Exception):
    """A step on the PCI bus failed; the message says which, on which device, and what to do."""


@dataclass(frozen=True)
class CharDevice:
    """A character device node and its numbers, as sysfs's ``dev`` file gives them."""

    path: str
    major: int
    minor: int


@dataclass(frozen=True)
class PassthroughGpu:
    """A GPU that can be passed through: its passthrough device's index and its IOMMU group."""

    index: int  # among the node's NVIDIA GPUs in PCI address order: gpu-vfio-<index>
    address: str  # "0000:3b:00.0"
    iommu_group: int
    iommufd: bool  # the kernel offers IOMMUFD (/dev/iommu and a cdev per device)
    # The size of its 64-bit memory BARs, rounded up to a power of two: the window a VM's firmware
    # must map for it (NVIDIA's addressableMemory); None where sysfs does not say.
    addressable_memory: int | None = None


def _write(path: Path, text: str) -> None:
    # sysfs takes one write(2) per attribute; open without O_CREAT, as nothing here is created.
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


class PciBus:
    """The PCI devices under ``root`` (a sysfs mount): reads, and driver moves through ``write``."""

    def __init__(self, root: Path, write: Write = _write) -> None:
        self.root = root
        self._write = write

    def _device(self, address: str) -> Path:
        return self.root / "bus" / "pci" / "devices" / address

    def exists(self, address: str) -> bool:
        return self._device(address).is_dir()

    def nvidia_gpus(self) -> tuple[str, ...]:
        """Addresses of every NVIDIA GPU function on the bus, whichever driver holds it, in PCI order."""
        directory = self.root / "bus" / "pci" / "devices"
        if not directory.is_dir():
            return ()
        found = []
        for device in directory.iterdir():
            try:
                vendor = (device / "vendor").read_text().strip()
                pci_class = (device / "class").read_text().strip()
            except OSError:
                continue
            if vendor == NVIDIA_VENDOR and pci_class.startswith(_GPU_CLASSES):
                found.append(device.name)
        return tuple(sorted(found, key=lambda address: int(address.replace(":", "").replace(".", ""), 16)))

    def passthrough_gpus(self) -> dict[str, PassthroughGpu]:
        """By PCI address, the GPUs that can be passed through: those in an IOMMU group."""
        iommufd = (self.root / "class" / "misc" / "iommu").exists()
        gpus = {}
        for index, address in enumerate(self.nvidia_gpus()):
            group = self.iommu_group(address)
            if group is not None:
                bars = self.addressable_memory(address)
                gpus[address] = PassthroughGpu(index, address, group, iommufd, bars)
        return gpus

    def addressable_memory(self, address: str) -> int | None:
        """The bytes of the device's 64-bit memory BARs together, rounded up to a power of two.

        As go-nvlib's ``GetTotalAddressableMemory`` reads ``resource`` for NVIDIA's driver: its first
        six lines are the BARs, a BAR whose flags' type bits (``0x6``) say 64-bit (``0x4``) counts;
        an H100's 128 GiB BAR1 and 32 MiB BAR3 make 256 GiB. None when the file cannot be read.
        """
        try:
            lines = (self._device(address) / "resource").read_text().splitlines()[:_BARS]
            total = 0
            for line in lines:
                start, end, flags = (int(field, 16) for field in line.split())
                if end != start and flags & _BAR_TYPE_MASK == _BAR_TYPE_64:
                    total += end - start + 1
        except (OSError, ValueError):
            return None
        return 1 << (total - 1).bit_length() if total else 0

    def driver(self, address: str) -> str | None:
        """The driver ``address`` is bound to; None when it is bound to none."""
        try:
            return Path(os.readlink(self._device(address) / "driver")).name
        except FileNotFoundError:
            return None

    def iommu_group(self, address: str) -> int | None:
        """The device's IOMMU group; None when the IOMMU is off (no passthrough possible then)."""
        try:
            return int(Path(os.readlink(self._device(address) / "iommu_group")).name)
        except FileNotFoundError:
            return None

    def group_members(self, group: int) -> tuple[str, ...]:
        directory = self.root / "kernel" / "iommu_groups" / str(group) / "devices"
        return tuple(sorted(entry.name for entry in directory.iterdir()))

    def busy_group_members(self, address: str) -> dict[str, str]:
        """The other functions of the device's IOMMU group that a host driver uses, with that driver.

        VFIO gives a VM a whole group or nothing: while another function of it is bound to a host
        driver (an audio function on snd_hda_intel, a NIC), the group cannot be opened.
        """
        group = self.iommu_group(address)
        if group is None:
            return {}
        busy: dict[str, str] = {}
        for member in self.group_members(group):
            driver = self.driver(member)
            if member != address and driver is not None and driver not in _HARMLESS_DRIVERS:
                busy[member] = driver
        return busy

    def vfio_cdev(self, address: str) -> CharDevice | None:
        """The IOMMUFD cdev ``/dev/vfio/devices/vfio<N>`` of a device on vfio-pci, if the kernel has it."""
        directory = self._device(address) / "vfio-dev"
        names = sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
        if not names:
            return None
        return self._char_device(directory / names[0] / "dev", f"/dev/vfio/devices/{names[0]}")

    def group_device(self, group: int) -> CharDevice:
        """``/dev/vfio/<group>``, which exists while a function of the group is bound to vfio-pci."""
        return self._char_device(self.root / "class" / "vfio" / str(group) / "dev", f"/dev/vfio/{group}")

    def container_device(self) -> CharDevice:
        """``/dev/vfio/vfio``, the legacy VFIO container every VM process opens beside its group."""
        return self._char_device(self.root / "class" / "misc" / "vfio" / "dev", "/dev/vfio/vfio")

    def _char_device(self, dev_file: Path, path: str) -> CharDevice:
        try:
            major, _, minor = dev_file.read_text().strip().partition(":")
            return CharDevice(path, int(major), int(minor))
        except (OSError, ValueError) as error:
            raise PciError(f"cannot read the numbers of {path} from {dev_file}: {error}") from None

    # --- moving a device between drivers --------------------------------------------------------

    def bind_vfio(self, address: str) -> None:
        """Move ``address`` from nvidia to vfio-pci; on failure put it back on nvidia, then raise."""
        try:
            self._move(address, VFIO_PCI)
        except PciError as error:
            try:
                self._move(address, NVIDIA)
            except PciError as undo:
                raise PciError(
                    f"{error}; rolling back to {NVIDIA} failed too: {undo}. The GPU is not usable until "
                    f"an administrator binds it (echo {address} > /sys/bus/pci/drivers/{NVIDIA}/bind)"
                ) from None
            raise PciError(f"{error}; the GPU was bound back to {NVIDIA}") from None

    def bind_nvidia(self, address: str) -> None:
        """Give ``address`` back to the nvidia driver (unprepare; also after a failed bind_vfio)."""
        self._move(address, NVIDIA)

    def _move(self, address: str, target: str) -> None:
        """Unbind, set driver_override, bind, and check; each step skipped when already done."""
        device = self._device(address)
        current = self.driver(address)
        if current == target and (target == VFIO_PCI or self._override(address) is None):
            return
        if current is not None:
            self._step("unbind", device / "driver" / "unbind", address, address, current)
        # vfio-pci matches no device by itself: the override makes it take this one. For nvidia
        # the override is cleared ("\n"), so that any later probe picks the device's own driver.
        self._step(
            "driver_override", device / "driver_override", target if target != NVIDIA else "\n", address
        )
        self._step("bind", self.root / "bus" / "pci" / "drivers" / target / "bind", address, address, target)
        now = self.driver(address)
        if now != target:
            raise PciError(f"GPU {address} is bound to {now or 'no driver'} after binding it to {target}")

    def _override(self, address: str) -> str | None:
        try:
            text = (self._device(address) / "driver_override").read_text().strip()
        except FileNotFoundError:
            return None
        return None if text in ("", "(null)") else text

    def _step(self, step: str, path: Path, text: str, address: str, driver: str | None = None) -> None:
        try:
            self._write(path, text)
        except OSError as error:
            reason = os.strerror(error.errno) if error.errno else str(error)
            where = f" ({driver})" if driver else ""
            hint = (
                " (is the vfio-pci module loaded? modprobe vfio-pci)" if error.errno == errno.ENOENT else ""
            )
            raise PciError(f"cannot {step} GPU {address}{where}: {reason}{hint}") from None
