"""Moving a GPU between nvidia and vfio-pci, step by step on a simulated sysfs tree."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from dra_driver.devices.pci import NVIDIA, VFIO_PCI, CharDevice, PciBus, PciError
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.sysfs import VFIO_GROUP_MAJOR, SimulatedKernel, add_function, build_tree

GPU = "0000:3b:00.0"
OTHER = "0000:86:00.0"


@pytest.fixture
def kernel(tmp_path: Path) -> SimulatedKernel:
    build_tree(tmp_path, [(GPU, 20), (OTHER, 21)])
    return SimulatedKernel(tmp_path)


@pytest.fixture
def bus(kernel: SimulatedKernel) -> PciBus:
    return PciBus(kernel.root, kernel.write)


def test_a_gpu_starts_on_nvidia_in_its_own_group(bus: PciBus) -> None:
    assert bus.driver(GPU) == NVIDIA
    assert bus.iommu_group(GPU) == 20
    assert bus.group_members(20) == (GPU,)
    assert bus.vfio_cdev(GPU) is None
    assert bus.container_device() == CharDevice("/dev/vfio/vfio", 10, 196)


def test_bind_vfio_takes_the_kernels_three_steps_and_gives_the_group_device(
    bus: PciBus, kernel: SimulatedKernel
) -> None:
    bus.bind_vfio(GPU)
    assert kernel.steps == [
        (f"bus/pci/devices/{GPU}/driver/unbind", GPU),
        (f"bus/pci/devices/{GPU}/driver_override", VFIO_PCI),
        (f"bus/pci/drivers/{VFIO_PCI}/bind", GPU),
    ]
    assert bus.driver(GPU) == VFIO_PCI
    assert bus.group_device(20) == CharDevice("/dev/vfio/20", VFIO_GROUP_MAJOR, 20)
    cdev = bus.vfio_cdev(GPU)
    assert cdev is not None
    assert cdev.path.startswith("/dev/vfio/devices/vfio")
    assert bus.driver(OTHER) == NVIDIA  # the other GPU is untouched


def test_bind_nvidia_puts_it_back_and_clears_the_override(bus: PciBus, kernel: SimulatedKernel) -> None:
    bus.bind_vfio(GPU)
    bus.bind_nvidia(GPU)
    assert bus.driver(GPU) == NVIDIA
    assert (kernel.root / f"bus/pci/devices/{GPU}/driver_override").read_text() == "(null)\n"
    assert not (kernel.root / "class/vfio/20").exists()
    assert bus.vfio_cdev(GPU) is None


def test_moves_are_idempotent(bus: PciBus, kernel: SimulatedKernel) -> None:
    bus.bind_vfio(GPU)
    steps = len(kernel.steps)
    bus.bind_vfio(GPU)
    assert len(kernel.steps) == steps
    bus.bind_nvidia(GPU)
    steps = len(kernel.steps)
    bus.bind_nvidia(GPU)
    assert len(kernel.steps) == steps


@pytest.mark.parametrize("step", ["unbind", "driver_override", "bind"])
def test_a_failed_step_rolls_back_to_nvidia(bus: PciBus, kernel: SimulatedKernel, step: str) -> None:
    kernel.fail(step, errno.EBUSY)
    with pytest.raises(
        PciError, match=rf"cannot {step} GPU {GPU}.*Device or resource busy.*bound back to nvidia"
    ):
        bus.bind_vfio(GPU)
    assert bus.driver(GPU) == NVIDIA
    assert (kernel.root / f"bus/pci/devices/{GPU}/driver_override").read_text() == "(null)\n"
    bus.bind_vfio(GPU)  # nothing is left behind that stops the next attempt
    assert bus.driver(GPU) == VFIO_PCI


def test_vfio_pci_refuses_a_device_without_the_override(bus: PciBus, kernel: SimulatedKernel) -> None:
    # What the kernel answers to the bind alone, the step NVIDIA's users saw leave GPUs unbound.
    kernel.write(kernel.root / f"bus/pci/devices/{GPU}/driver/unbind", GPU)
    with pytest.raises(OSError, match="No such device") as error:
        kernel.write(kernel.root / f"bus/pci/drivers/{VFIO_PCI}/bind", GPU)
    assert error.value.errno == errno.ENODEV


def test_a_failed_rollback_says_how_to_recover_by_hand(bus: PciBus, kernel: SimulatedKernel) -> None:
    # The move's override write fails, then the rollback's bind to nvidia.
    kernel.fail("driver_override", errno.EIO)
    kernel.fail("bind", errno.ENODEV)
    with pytest.raises(PciError, match=rf"rolling back to nvidia failed too.*echo {GPU} > /sys/bus/pci/"):
        bus.bind_vfio(GPU)


def test_busy_group_members_are_the_others_on_host_drivers(bus: PciBus, kernel: SimulatedKernel) -> None:
    add_function(kernel.root, "0000:3b:00.1", 20, "snd_hda_intel", pci_class=0x040300)
    add_function(kernel.root, "0000:3a:00.0", 20, "pcieport", pci_class=0x060400)
    assert bus.busy_group_members(GPU) == {"0000:3b:00.1": "snd_hda_intel"}
    assert bus.busy_group_members(OTHER) == {}


def test_passthrough_indexes_follow_pci_order_and_survive_a_gpu_on_vfio(
    bus: PciBus, kernel: SimulatedKernel
) -> None:
    add_function(kernel.root, "0000:3b:00.1", 20, "snd_hda_intel", pci_class=0x040300)  # not a GPU
    add_function(kernel.root, "0000:0a:00.0", 22, NVIDIA)
    before = bus.passthrough_gpus()
    assert [(g.address, g.index, g.iommu_group) for g in before.values()] == [
        ("0000:0a:00.0", 0, 22),
        (GPU, 1, 20),
        (OTHER, 2, 21),
    ]
    assert not before[GPU].iommufd
    bus.bind_vfio(GPU)
    (kernel.root / "class/misc/iommu").mkdir()
    after = bus.passthrough_gpus()
    assert [g.index for g in after.values()] == [0, 1, 2]
    assert after[GPU].iommufd


def test_a_simulated_gpu_on_vfio_pci_is_gone_from_nvmls_view_until_it_is_back(tmp_path: Path) -> None:
    node = SimulatedBackend("dgx-h100", "node-a", tmp_path)
    gpu = node.inventory().gpus[1]
    assert node.pci().passthrough_gpus()[gpu.pci_bus_id].index == 1
    node.pci().bind_vfio(gpu.pci_bus_id)
    assert gpu.uuid not in {g.uuid for g in node.inventory().gpus}
    assert len(node.inventory().gpus) == 7
    node.pci().bind_nvidia(gpu.pci_bus_id)
    assert gpu in node.inventory().gpus


def test_a_reboot_puts_every_simulated_gpu_back_on_nvidia(tmp_path: Path) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("one\n")
    node = SimulatedBackend("dgx-h100", "node-a", tmp_path / "sim", boot_id_path=boot)
    address = node.inventory().gpus[0].pci_bus_id
    node.pci().bind_vfio(address)
    assert len(node.inventory().gpus) == 7
    boot.write_text("two\n")
    assert len(node.inventory().gpus) == 8
    assert node.pci().driver(address) == NVIDIA


# A real H100 SXM's resource file (lspci: BAR0 16M, BAR1 128G prefetchable 64-bit, BAR3 32M 64-bit);
# the second line's empty BAR is BAR1's upper half, the seventh the expansion ROM.
H100_RESOURCE = """\
0x00000000e2000000 0x00000000e2ffffff 0x0000000000040200
0x0000228000000000 0x0000229fffffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x000022a000000000 0x000022a001ffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x00000000e3000000 0x00000000e307ffff 0x0000000000046200
"""


def test_addressable_memory_is_the_64_bit_bars_rounded_up_to_a_power_of_two(
    bus: PciBus, kernel: SimulatedKernel
) -> None:
    """As NVIDIA's driver reads it (go-nvlib's GetTotalAddressableMemory): 128 GiB + 32 MiB -> 256 GiB."""
    (kernel.root / f"bus/pci/devices/{GPU}/resource").write_text(H100_RESOURCE)
    assert bus.addressable_memory(GPU) == 256 << 30
    assert bus.passthrough_gpus()[GPU].addressable_memory == 256 << 30
    assert bus.addressable_memory(OTHER) is None  # no resource file: nothing to say


def test_a_simulated_gpus_bars_are_sized_from_its_memory(tmp_path: Path) -> None:
    node = SimulatedBackend("dgx-h100", "node-a", tmp_path)
    address = node.inventory().gpus[0].pci_bus_id
    # an H100's 80 GB: a 128 GiB BAR1 beside the 32 MiB BAR3, as the real file above has them
    assert node.pci().addressable_memory(address) == 256 << 30
    lines = (node.sysfs_root / f"bus/pci/devices/{address}/resource").read_text().splitlines()
    assert len(lines) == len(H100_RESOURCE.splitlines()) + 6  # six SR-IOV BARs after the ROM
    sizes = [int(end, 16) - int(start, 16) + 1 for start, end, _ in (line.split() for line in lines[:4])]
    assert sizes[:2] == [16 << 20, 128 << 30]
    assert sizes[3] == 32 << 20
