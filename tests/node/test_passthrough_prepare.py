"""Passthrough in the node layer: prepare moves the GPU to vfio-pci on the simulated node's sysfs
tree, unprepare gives it back, and every refusal and failed step leaves it on nvidia.

The simulated node ("mixed") has two H100s (gpu-0, gpu-1), two A100-40GBs and two L4s; each GPU
sits alone in its IOMMU group. The kernel's part (a bind creating the driver link and the group's
device) is played by :class:`dra_driver.simulated.sysfs.SimulatedKernel`, which also fails a
chosen step on request.
"""

from __future__ import annotations

import errno
import json
import shutil
from typing import Any

import pytest

from dra_driver.devices.pci import NVIDIA, VFIO_PCI, PassthroughGpu, PciBus
from dra_driver.node.preparer import NodePreparer
from dra_driver.node.types import ClaimError, ClaimRef
from dra_driver.simulated.sysfs import SimulatedKernel, add_function

from .builders import Node, new_ref, opaque

NVIDIA_API = "resource.nvidia.com/v1beta1"


def vfio_config(**iommu: Any) -> dict[str, Any]:
    return opaque({"apiVersion": NVIDIA_API, "kind": "VfioDeviceConfig", "iommu": iommu})


def bus(node: Node) -> PciBus:
    return node.backend.pci()


def kernel(node: Node) -> SimulatedKernel:
    bus(node)
    assert node.backend.kernel is not None
    return node.backend.kernel


def places(node: Node) -> dict[str, PassthroughGpu]:
    return bus(node).passthrough_gpus()


_ADDRESSES: dict[str, dict[int, str]] = {}  # per node: minor -> PCI address, read while all are on nvidia


def place_of(node: Node, minor: int) -> PassthroughGpu:
    addresses = _ADDRESSES.setdefault(
        str(node.root), {g.minor: g.pci_bus_id for g in node.backend.inventory().gpus}
    )
    return places(node)[addresses[minor]]


def vfio_name(node: Node, minor: int) -> str:
    return f"gpu-vfio-{place_of(node, minor).index}"


async def started(node: Node) -> NodePreparer:
    place_of(node, 0)  # the addresses, read while every GPU is on nvidia
    return await node.started(passthrough=places(node))


async def prepare(preparer: NodePreparer, ref: ClaimRef) -> object:
    return (await preparer.prepare([ref]))[ref.uid]


def refused(outcome: object) -> str:
    assert isinstance(outcome, ClaimError), outcome
    return outcome.message


def spec(node: Node, ref: ClaimRef) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(node.specs.path_for(ref.uid).read_text())
    return loaded


def on_nvidia_and_unclaimed(node: Node, ref: ClaimRef, minor: int = 0) -> None:
    assert bus(node).driver(place_of(node, minor).address) == NVIDIA
    assert ref.uid not in node.on_disk().claims
    assert not node.specs.path_for(ref.uid).exists()


async def test_nvidias_claim_gets_the_gpu_on_vfio_pci_and_unprepare_gives_it_back(node: Node) -> None:
    preparer = await started(node)
    vm, place = new_ref("vm"), place_of(node, 0)
    gpu_uuid = node.backend.inventory().gpus[0].uuid
    node.allocate(
        vm, vfio_name(node, 0), configs=[vfio_config(backendPolicy="LegacyOnly", enableAPIDevice=True)]
    )

    outcome = await prepare(preparer, vm)

    assert not isinstance(outcome, ClaimError), outcome
    assert bus(node).driver(place.address) == VFIO_PCI
    assert gpu_uuid not in {g.uuid for g in node.backend.inventory().gpus}  # gone from NVML's view
    written = spec(node, vm)
    (device,) = written["devices"]
    assert device["containerEdits"] == {
        "env": [f"DRA_GPU_PASSTHROUGH_{vfio_name(node, 0).upper().replace('-', '_')}=gpu-0,{place.address}"],
        "deviceNodes": [{"path": f"/dev/vfio/{place.iommu_group}"}],
    }
    # The VM's process gets the VFIO container, and no NVIDIA driver: no libraries, hooks, nvidiactl.
    assert written["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void"],
        "deviceNodes": [{"path": "/dev/vfio/vfio", "type": "c", "major": 10, "minor": 196}],
    }
    (record,) = node.on_disk().claims[vm.uid].devices
    assert record.passthrough is not None
    assert (record.passthrough.parent_device, record.passthrough.pci_bus_id) == ("gpu-0", place.address)
    assert record.config == {
        "apiVersion": "resource.dra-driver.dev/v1alpha1",
        "kind": "VfioDeviceConfig",
        "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True},
    }

    assert (await preparer.unprepare([vm]))[vm.uid] is None
    on_nvidia_and_unclaimed(node, vm)
    assert gpu_uuid in {g.uuid for g in node.backend.inventory().gpus}


async def test_without_the_api_device_the_container_gets_the_group_alone(node: Node) -> None:
    preparer = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 1))  # no config: NVIDIA's default, LegacyOnly without it

    assert not isinstance(await prepare(preparer, vm), ClaimError)
    assert spec(node, vm)["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}


async def test_a_gpu_with_processes_is_not_passed_through(node: Node) -> None:
    preparer = await started(node)
    vm = new_ref("vm")
    node.backend.set_busy(0, True)
    node.allocate(vm, vfio_name(node, 0))

    assert "has 1 process(es) running, so it cannot be passed through" in refused(await prepare(preparer, vm))
    on_nvidia_and_unclaimed(node, vm)
    node.backend.set_busy(0, False)
    assert not isinstance(await prepare(preparer, vm), ClaimError)


async def test_a_gpu_whose_iommu_group_holds_a_device_the_host_uses_is_not_passed_through(node: Node) -> None:
    preparer = await started(node)
    vm, place = new_ref("vm"), place_of(node, 0)
    audio = place.address[:-1] + "1"
    add_function(bus(node).root, audio, place.iommu_group, "snd_hda_intel", pci_class=0x040300)
    node.allocate(vm, vfio_name(node, 0))

    message = refused(await prepare(preparer, vm))
    assert f"its IOMMU group {place.iommu_group} also holds {audio} (snd_hda_intel)" in message
    on_nvidia_and_unclaimed(node, vm)


async def test_a_gpu_in_mig_mode_is_not_passed_through(node: Node) -> None:
    preparer = await started(node)
    vm = new_ref("vm")
    node.backend.admin_create_mig(0, "1g.10gb", 0)
    node.allocate(vm, vfio_name(node, 0))

    assert "is in MIG mode or has MIG devices" in refused(await prepare(preparer, vm))
    on_nvidia_and_unclaimed(node, vm)


@pytest.mark.parametrize("step", ["unbind", "driver_override", "bind"])
async def test_a_failed_step_leaves_the_gpu_on_nvidia_and_the_claim_unprepared(node: Node, step: str) -> None:
    preparer = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0))
    kernel(node).fail(step, errno.EBUSY)

    message = refused(await prepare(preparer, vm))
    assert f"cannot {step} GPU" in message
    assert "bound back to nvidia" in message
    on_nvidia_and_unclaimed(node, vm)
    assert not isinstance(await prepare(preparer, vm), ClaimError)  # the kubelet's retry
    assert bus(node).driver(place_of(node, 0).address) == VFIO_PCI


async def test_a_passed_through_gpu_serves_no_other_claim_and_the_other_way_round(node: Node) -> None:
    preparer = await started(node)
    vm, pod, mig = new_ref("vm"), new_ref("pod"), new_ref("mig")
    node.allocate(pod, "gpu-0")
    assert not isinstance(await prepare(preparer, pod), ClaimError)
    node.allocate(vm, vfio_name(node, 0))
    assert "claim default/pod" in refused(await prepare(preparer, vm))
    assert bus(node).driver(place_of(node, 0).address) == NVIDIA

    assert (await preparer.unprepare([pod]))[pod.uid] is None
    assert not isinstance(await prepare(preparer, vm), ClaimError)
    node.allocate(pod, "gpu-0")
    node.allocate(mig, "gpu-0-mig-1g10gb-19-0")
    for other in (pod, mig):  # stale allocations: the GPU is on vfio-pci, NVML lists it no more
        assert "does not exist on this node" in refused(await prepare(preparer, other))
    assert bus(node).driver(place_of(node, 0).address) == VFIO_PCI


async def test_a_passthrough_device_shares_no_claim_with_a_gpu(node: Node) -> None:
    preparer = await started(node)
    both = new_ref("both")
    node.allocate(both, vfio_name(node, 0), "gpu-1")
    assert "shares no claim with devices for containers" in refused(await prepare(preparer, both))
    on_nvidia_and_unclaimed(node, both)


async def test_with_passthrough_off_its_devices_are_refused(node: Node) -> None:
    preparer = await node.started()
    vm = new_ref("vm")
    node.allocate(vm, "gpu-vfio-0")
    assert "passthrough is off (--passthrough)" in refused(await prepare(preparer, vm))


async def test_after_a_lost_store_the_spec_rebuilds_the_claim_and_its_unprepare_binds_back(
    node: Node,
) -> None:
    first = await started(node)
    vm, pod = new_ref("vm"), new_ref("pod")
    node.allocate(vm, vfio_name(node, 0))
    assert not isinstance(await prepare(first, vm), ClaimError)
    first.close()

    shutil.rmtree(node.state_dir)
    second = await started(node)

    (device,) = node.on_disk().claims[vm.uid].devices
    assert device.passthrough is not None
    assert device.passthrough.parent_device == "gpu-0"
    node.allocate(pod, "gpu-0-mig-1g10gb-19-0")  # the GPU's MIG placement stays excluded too
    assert isinstance(await prepare(second, pod), ClaimError)
    assert (await second.unprepare([vm]))[vm.uid] is None
    on_nvidia_and_unclaimed(node, vm)


async def test_a_retry_after_a_crash_on_vfio_pci_starts_from_nvidia_again(node: Node) -> None:
    first = await started(node)
    vm, place = new_ref("vm"), place_of(node, 0)
    node.allocate(vm, vfio_name(node, 0))
    assert not isinstance(await prepare(first, vm), ClaimError)
    node.specs.remove(vm.uid)  # as a crash before the spec leaves it: the record, the GPU on vfio-pci

    second = await started(node)
    assert not isinstance(await prepare(second, vm), ClaimError)
    assert bus(node).driver(place.address) == VFIO_PCI
    assert node.specs.path_for(vm.uid).exists()
    assert (await second.unprepare([vm]))[vm.uid] is None
    on_nvidia_and_unclaimed(node, vm)


async def test_when_the_rollback_fails_too_the_undo_binds_the_gpu_back(node: Node) -> None:
    preparer = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0))
    kernel(node).fail("driver_override", errno.EIO)  # the move's override write ...
    kernel(node).fail("bind", errno.ENODEV)  # ... and the rollback's bind to nvidia

    assert "rolling back to nvidia failed too" in refused(await prepare(preparer, vm))
    on_nvidia_and_unclaimed(node, vm)  # the failed prepare's undo bound it


@pytest.mark.parametrize("policy", ["PreferIommuFD", "LegacyOnly"])
async def test_under_iommufd_prefer_iommufd_gets_the_cdev_and_dev_iommu(node: Node, policy: str) -> None:
    place_of(node, 0)
    (bus(node).root / "class/misc/iommu").mkdir(parents=True)  # the kernel has IOMMUFD
    preparer = await started(node)
    vm = new_ref("vm")
    node.allocate(vm, vfio_name(node, 0), configs=[vfio_config(backendPolicy=policy, enableAPIDevice=True)])

    assert not isinstance(await prepare(preparer, vm), ClaimError)

    written = spec(node, vm)
    (device,) = written["devices"]
    cdev = bus(node).vfio_cdev(place_of(node, 0).address)
    assert cdev is not None
    if policy == "PreferIommuFD":
        assert device["containerEdits"]["deviceNodes"] == [{"path": cdev.path}]
        assert written["containerEdits"]["deviceNodes"] == [{"path": "/dev/iommu"}]
    else:
        assert device["containerEdits"]["deviceNodes"] == [
            {"path": f"/dev/vfio/{place_of(node, 0).iommu_group}"}
        ]
        assert written["containerEdits"]["deviceNodes"][0]["path"] == "/dev/vfio/vfio"
