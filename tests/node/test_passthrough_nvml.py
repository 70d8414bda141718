"""Passthrough on the NVML backend, over the mock libnvidia-ml.so.1 and a sysfs tree of its GPUs.

The node of :mod:`tests.node.test_passthrough_prepare`, with NVML underneath: two H100 of NVIDIA's
go-nvml mock (``dgxh100:2``), the driver's :class:`NvmlBackend` loaded from a driver root, and the
sysfs tree the simulator builds for its own GPUs built for the mock's (``install_gpu_tree``). The
kernel's part of a bind is the simulator's stand-in; the mock reads the same tree and, as NVML on
a host, stops listing a GPU that is off nvidia.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pynvml
import pytest

from dra_driver.devices.nvml import NvmlBackend
from dra_driver.devices.pci import NVIDIA, VFIO_PCI
from dra_driver.node.types import ClaimError
from dra_driver.simulated.sysfs import SimulatedKernel
from tests.mock_nvml import MockNvml, install_driver_root, install_gpu_tree, install_procfs

from .builders import InMemoryClaims, Node, RecordingObserver, new_ref, opaque

H100_ADDRESSABLE_MEMORY = 256 << 30  # its 80 GB behind a 128 GiB BAR1, and the 32 MiB BAR3
VFIO_CONFIG = opaque(
    {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "VfioDeviceConfig",
        "iommu": {"enableAPIDevice": True},
    }
)


@pytest.fixture
def nvml_node(tmp_path: Path) -> Iterator[tuple[Node, MockNvml, SimulatedKernel]]:
    mock = MockNvml()
    procfs = install_procfs(tmp_path / "proc")
    root = install_driver_root(tmp_path / "driver-root")
    sysfs = tmp_path / "sys"
    mock.configure("dgxh100:2", proc_root=procfs, sysfs_root=sysfs)
    (tmp_path / "boot_id").write_text(f"{uuid.uuid4()}\n")
    backends = [NvmlBackend(procfs_root=procfs, dev_root=root, driver_root=root, read_only=True)]
    kernel = install_gpu_tree(sysfs, backends[0].inventory())
    backends.append(
        NvmlBackend(
            sysfs_root=sysfs,
            procfs_root=procfs,
            dev_root=root,
            driver_root=root,
            state_dir=tmp_path / "state",
            pci_write=kernel.write,
        )
    )
    yield Node(tmp_path, backends[1], InMemoryClaims(), RecordingObserver()), mock, kernel  # type: ignore[arg-type]
    for backend in backends:
        backend.close()


async def test_nvidias_claim_moves_a_mock_gpu_to_vfio_pci_out_of_nvmls_view_and_back(
    nvml_node: tuple[Node, MockNvml, SimulatedKernel],
) -> None:
    node, _, kernel = nvml_node
    first, second = node.backend.inventory().gpus
    places = node.backend.pci().passthrough_gpus()
    assert [(p.index, p.iommu_group, p.addressable_memory) for p in places.values()] == [
        (0, 20, H100_ADDRESSABLE_MEMORY),
        (1, 21, H100_ADDRESSABLE_MEMORY),
    ]
    preparer = await node.started(passthrough=places)
    vm, workload = new_ref("vm"), new_ref("workload")
    node.allocate(vm, "gpu-vfio-0", configs=[VFIO_CONFIG])

    outcome = (await preparer.prepare([vm]))[vm.uid]

    assert not isinstance(outcome, ClaimError), outcome
    assert node.backend.pci().driver(first.pci_bus_id) == VFIO_PCI
    assert [step for step, _ in kernel.steps] == [
        f"bus/pci/devices/{first.pci_bus_id}/driver/unbind",
        f"bus/pci/devices/{first.pci_bus_id}/driver_override",
        f"bus/pci/drivers/{VFIO_PCI}/bind",
    ]
    # NVML on the host: the GPU is gone, the other keeps its minor and is now index 0.
    assert [g.uuid for g in node.backend.inventory().gpus] == [second.uuid]
    assert pynvml.nvmlDeviceGetCount() == 1
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID(first.uuid)
    (device,) = json.loads(node.specs.path_for(vm.uid).read_text())["devices"]
    assert device["containerEdits"]["deviceNodes"] == [{"path": "/dev/vfio/20"}]
    # While the VM holds it, the GPU is nobody else's.
    node.allocate(workload, "gpu-0")
    assert isinstance((await preparer.prepare([workload]))[workload.uid], ClaimError)

    assert (await preparer.unprepare([vm]))[vm.uid] is None
    assert node.backend.pci().driver(first.pci_bus_id) == NVIDIA
    assert [g.uuid for g in node.backend.inventory().gpus] == [first.uuid, second.uuid]
    assert not node.specs.path_for(vm.uid).exists()
    assert not isinstance((await preparer.prepare([workload]))[workload.uid], ClaimError)


async def test_a_mock_gpu_with_a_process_is_not_passed_through(
    nvml_node: tuple[Node, MockNvml, SimulatedKernel],
) -> None:
    node, mock, kernel = nvml_node
    preparer = await node.started(passthrough=node.backend.pci().passthrough_gpus())
    vm = new_ref("vm")
    mock.control("busy 0 on")  # a compute process, as nvmlDeviceGetComputeRunningProcesses lists it
    node.allocate(vm, "gpu-vfio-0")

    outcome = (await preparer.prepare([vm]))[vm.uid]

    assert isinstance(outcome, ClaimError)
    assert "has 1 process(es) running, so it cannot be passed through" in outcome.message
    assert kernel.steps == []
    mock.control("busy 0 off")
    assert not isinstance((await preparer.prepare([vm]))[vm.uid], ClaimError)
