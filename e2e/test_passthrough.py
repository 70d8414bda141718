"""GPU passthrough as NVIDIA's users write it, through the real control plane.

A simulated DGX H100 runs the driver under NVIDIA's name with --passthrough; NVIDIA's DeviceClass
vfio.gpu.nvidia.com and its quickstart claim with a VfioDeviceConfig (docs/examples/nvidia/
passthrough.yaml) go through the real API server and scheduler to the kubelet's DRA manager. The
GPU's driver binding is read from the node's simulated sysfs tree, where the driver changed it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.devices.pci import NVIDIA, VFIO_PCI, PciBus
from dra_driver.node.nvidia_config import NVIDIA_DRIVER_NAME
from e2e import manifests
from e2e.claims import claim_and_pod, wait_unschedulable
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode, published_devices
from e2e.workloads import delete_pod, pod_claim, pod_path, wait_running

pytestmark = pytest.mark.e2e

NVIDIA_EXAMPLES = manifests.EXAMPLES / "nvidia"
EXAMPLE = manifests.load(NVIDIA_EXAMPLES / "passthrough.yaml")
VM_CLAIM, VM_POD = "single-gpu-full-vfioconfig", "pod1-full-vfioconfig"

RETRY_S = 240  # an unschedulable pod's next scheduling attempt, on a loaded machine


@pytest.fixture(scope="module")
def device_classes(cluster: ClusterInfo) -> Iterator[None]:
    rest = cluster.rest()
    classes = [
        *manifests.load(NVIDIA_EXAMPLES / "deviceclasses.yaml"),
        *manifests.of_kind(EXAMPLE, "DeviceClass"),
    ]
    with manifests.created(rest, classes):
        yield


@pytest.fixture(scope="module")
def vfio_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    device_classes: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-vfio"),
        "node-vfio",
        driver_args=["--passthrough", "--mig-partitions=all"],
        driver_name=NVIDIA_DRIVER_NAME,
    )
    try:
        node.start()
        rest = cluster.rest()
        wait_until(
            lambda: "gpu-vfio-7" in published_devices(rest, node.name, NVIDIA_DRIVER_NAME),
            timeout_seconds=60,
            waiting_for="the passthrough devices to be published",
        )
        yield node
    finally:
        node.remove()


def bus(node: GpuNode) -> PciBus:
    return PciBus(node.driver.paths.data / "sysfs")  # the simulated node's tree; only read here


def passed_through(spec: JsonObject) -> tuple[str, str]:
    """(gpu-<minor>, PCI address) of the claim's one passthrough device, as its spec names them."""
    (device,) = spec["devices"]
    (marker,) = [v for v in device["containerEdits"]["env"] if v.startswith("DRA_GPU_PASSTHROUGH_")]
    gpu, address = marker.split("=", 1)[1].split(",")
    return gpu, address


def test_nvidias_passthrough_claim_gets_the_gpu_on_vfio_and_holds_it_against_full_and_mig_claims(
    rest: RestClient, vfio_node: GpuNode, namespace: str
) -> None:
    node = vfio_node
    objects = [o for o in EXAMPLE if o["kind"] != "DeviceClass"]
    manifests.apply(rest, manifests.pinned(objects, node.name), namespace)

    claim = pod_claim(rest, wait_running(rest, namespace, VM_POD), "gpu")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["device"].startswith("gpu-vfio-")
    spec: JsonObject = json.loads(node.driver.spec_path(claim["metadata"]["uid"]).read_text())
    gpu, address = passed_through(spec)
    group = bus(node).iommu_group(address)
    (device,) = spec["devices"]
    assert device["containerEdits"]["deviceNodes"] == [{"path": f"/dev/vfio/{group}"}]
    assert {"path": "/dev/vfio/vfio", "type": "c", "major": 10, "minor": 196} in spec["containerEdits"][
        "deviceNodes"
    ]
    assert "mounts" not in spec["containerEdits"]  # no NVIDIA driver for the VM's process
    assert bus(node).driver(address) == VFIO_PCI

    # The GPU has left NVML's view, and with it the slice: its full GPU and its MIG placements.
    minor = gpu.removeprefix("gpu-")
    wait_until(
        lambda: (
            not [
                name
                for name in published_devices(rest, node.name, NVIDIA_DRIVER_NAME)
                if name == gpu or name.startswith(f"{gpu}-mig-")
            ]
        ),
        timeout_seconds=30,
        waiting_for=f"{gpu} and its MIG devices to leave the slice",
    )
    bus_id = f'device.attributes["resource.kubernetes.io"].pciBusID == "{address}"'
    for name, device_class in (("whole", "gpu.nvidia.com"), ("part", "mig.nvidia.com")):
        manifests.apply(rest, claim_and_pod(name, device_class, bus_id, node.name), namespace)
        wait_unschedulable(rest, namespace, name)

    delete_pod(rest, namespace, VM_POD)
    wait_until(lambda: bus(node).driver(address) == NVIDIA, timeout_seconds=60, waiting_for="nvidia again")
    # Back on nvidia and in the slice: the waiting claims of the GPU now get it, one at a time, in
    # the order the scheduler picks (either may be first). It retries an unschedulable pod when the
    # slice changes, or once its backoff ends: on a loaded machine that can take longer than a pod's
    # usual start.
    waiting = {"whole": f"gpu-{minor}", "part": f"gpu-{minor}-mig-.+"}  # the device each gets
    while waiting:
        first = wait_until(
            lambda: next((name for name in waiting if is_running(rest, namespace, name)), None),
            timeout_seconds=RETRY_S,
            waiting_for=f"one of {sorted(waiting)} to get the GPU back",
        )
        claim = pod_claim(rest, rest.get(pod_path(namespace, first)), "gpu")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert re.fullmatch(waiting[first], result["device"]), result["device"]
        others = [name for name in waiting if name != first]
        assert not any(is_running(rest, namespace, name) for name in others), (
            "the full GPU and a MIG device at once"
        )
        delete_pod(rest, namespace, first)
        del waiting[first]


def is_running(rest: RestClient, namespace: str, name: str) -> bool:
    phase: str | None = rest.get(pod_path(namespace, name)).get("status", {}).get("phase")
    return phase == "Running"


def test_a_gpu_in_use_is_not_allocated_for_passthrough_by_the_scheduler(
    rest: RestClient, vfio_node: GpuNode, namespace: str
) -> None:
    """The counters: a full GPU's claim holds the GPU's counter set, which its passthrough device needs."""
    node = vfio_node
    published = published_devices(rest, node.name, NVIDIA_DRIVER_NAME)
    address = published["gpu-3"]["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
    bus_id = f'device.attributes["resource.kubernetes.io"].pciBusID == "{address}"'
    manifests.apply(rest, claim_and_pod("cuda", "gpu.nvidia.com", bus_id, node.name), namespace)
    wait_running(rest, namespace, "cuda")

    # NVIDIA's addressableMemory, as a VM's claim may select on it: an H100's BARs (128 GiB and 32 MiB).
    bars = 'device.capacity["gpu.nvidia.com"].addressableMemory.compareTo(quantity("256Gi")) == 0'
    manifests.apply(
        rest, claim_and_pod("vm", "vfio.gpu.nvidia.com", f"{bus_id} && {bars}", node.name), namespace
    )
    wait_unschedulable(rest, namespace, "vm")
    assert bus(node).driver(address) == NVIDIA

    delete_pod(rest, namespace, "cuda")
    wait_running(rest, namespace, "vm", timeout_seconds=RETRY_S)
    assert bus(node).driver(address) == VFIO_PCI
    delete_pod(rest, namespace, "vm")
    wait_until(lambda: bus(node).driver(address) == NVIDIA, timeout_seconds=60, waiting_for="nvidia again")
