"""GPU passthrough on the real node: NVIDIA's claim, prepared by the chart's plugin, and the
container that runc starts gets its GPU's VFIO group.

The chart is installed as NVIDIA's stand-in (driverName gpu.nvidia.com) with passthrough on, so it
installs NVIDIA's DeviceClass vfio.gpu.nvidia.com, and the claim is NVIDIA's quickstart claim with
its VfioDeviceConfig (docs/examples/nvidia/passthrough.yaml), its pod running this suite's workload
image (nothing is pulled). The plugin binds the GPU to vfio-pci in the simulated node's sysfs tree
(under its data directory); the CDI spec names ``/dev/vfio/<group>`` by its path alone, as NVIDIA's
does, so containerd reads the numbers from the node's own node: this machine has no IOMMU, so the
real node gives its /dev the VFIO nodes a GPU host has, in its own mount namespace
(``e2e/realnode/holder.py``, ``driver_root.vfio_device_nodes``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from dra_driver.devices.pci import NVIDIA, VFIO_PCI, PciBus
from dra_driver.simulated.sysfs import VFIO_GROUP_MAJOR, VFIO_MISC
from e2e import manifests
from e2e.cluster import ClusterInfo
from e2e.daemon import wait_until
from e2e.real_node.driver import CHART, NAMESPACE, RELEASE, DriverRelease
from e2e.real_node.gpu_view import container, view_of, workload_image
from e2e.realnode import config
from e2e.realnode.images import chart_app_version
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

DRIVER = "gpu.nvidia.com"
EXAMPLE = manifests.EXAMPLES / "nvidia" / "passthrough.yaml"
VM_CLAIM, VM_POD = "single-gpu-full-vfioconfig", "pod1-full-vfioconfig"

# What the VM's container sees: every device node it was given, with its numbers (hex), and the
# driver's variables.
VIEW_SCRIPT = """
echo '== devices'
for node in /dev/vfio/* /dev/vfio/devices/* /dev/iommu /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$node" ] && stat -c '%n %t %T' "$node"
done
echo '== env'
env | grep -e '^DRA_GPU_' -e '^NVIDIA_VISIBLE_DEVICES=' | sort
echo '== end'
trap 'exit 0' TERM
while :; do sleep 1; done
"""


@pytest.fixture(scope="module")
def driver(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart as gpu.nvidia.com with passthrough on: gpu-vfio-<index> devices and their class."""
    release = DriverRelease(real_cluster, real_node, helm, chart_app_version())
    release.helm_run(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *release.values(),
        "--set", f"driverName={DRIVER}",
        "--set", "passthrough=true",
    )  # fmt: skip
    try:
        release.wait_ready()
        wait_until(
            lambda: "gpu-vfio-7" in published(release),
            timeout_seconds=60,
            waiting_for="the passthrough devices to be published",
        )
        yield release
    finally:
        release.uninstall()


def published(release: DriverRelease) -> dict[str, dict[str, Any]]:
    """The node's devices of ``DRIVER`` by name, as its ResourceSlices publish them now."""
    slices = release.cluster.rest().get("/apis/resource.k8s.io/v1/resourceslices")["items"]
    return {
        device["name"]: device
        for s in slices
        if s["spec"]["driver"] == DRIVER
        for device in s["spec"].get("devices", [])
    }


def sysfs(release: DriverRelease) -> PciBus:
    """The simulated node's sysfs tree, where the plugin binds GPUs (its data directory); read only."""
    assert release.node.layout is not None
    return PciBus(release.node.layout.host_path(f"{config.KUBELET_ROOT}/plugins/{DRIVER}/sysfs"))


def nvidias_claim_and_pod() -> list[dict[str, Any]]:
    """NVIDIA's example claim and pod as written, but for the pod's image and what it runs; the class
    is the chart's."""
    objects = [o for o in manifests.load(EXAMPLE) if o["kind"] != "DeviceClass"]
    for obj in objects:
        if obj["kind"] == "Pod":
            (ctr,) = obj["spec"]["containers"]
            ours = container(ctr["name"], [c["name"] for c in ctr["resources"]["claims"]], VIEW_SCRIPT)
            assert ours["resources"] == ctr["resources"]
            obj["spec"]["containers"] = [{**ctr, **ours, "image": workload_image()}]
            obj["spec"]["terminationGracePeriodSeconds"] = 2
            obj["spec"]["automountServiceAccountToken"] = False
    return objects


def test_nvidias_passthrough_claim_gives_the_container_the_gpus_vfio_group_and_no_nvidia_device(
    driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    rest = driver.cluster.rest()
    assert rest.get("/apis/resource.k8s.io/v1/deviceclasses/vfio.gpu.nvidia.com")  # the chart's
    addresses = {
        name: device["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
        for name, device in published(driver).items()
        if name.startswith("gpu-vfio-")
    }
    for obj in nvidias_claim_and_pod():
        if obj["kind"] == "Pod":
            rest.create(f"/api/v1/namespaces/{namespace}/pods", obj)
        else:
            rest.create(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims", obj)

    view = view_of(real_api, namespace, VM_POD, "ctr")

    claim = rest.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{VM_CLAIM}")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER
    device = result["device"]
    assert device.startswith("gpu-vfio-")
    address = addresses[device]
    bus = sysfs(driver)
    group = bus.iommu_group(address)
    assert group is not None
    # The group and the VFIO container (enableAPIDevice), with the numbers of the node's nodes,
    # and nothing of the NVIDIA driver.
    assert dict(view.devices) == {
        f"/dev/vfio/{group}": (VFIO_GROUP_MAJOR, group),
        "/dev/vfio/vfio": VFIO_MISC,
    }
    variable = f"DRA_GPU_PASSTHROUGH_{device.upper().replace('-', '_')}"
    assert set(view.uuids) == {variable, "NVIDIA_VISIBLE_DEVICES"}
    assert view.uuids["NVIDIA_VISIBLE_DEVICES"] == "void"
    gpu, _, named = view.uuids[variable].partition(",")
    assert named == address
    # While the VM's pod runs its GPU is on vfio-pci, gone from NVML's view and so from the slice.
    assert bus.driver(address) == VFIO_PCI
    assert not {gpu, device} & set(published(driver))

    client.CoreV1Api(real_api).delete_namespaced_pod(VM_POD, namespace, grace_period_seconds=1)
    wait_until(
        lambda: bus.driver(address) == NVIDIA and {gpu, device} <= set(published(driver)),
        timeout_seconds=90,
        waiting_for=f"{address} back on nvidia and {gpu} published again after the pod's deletion",
    )
