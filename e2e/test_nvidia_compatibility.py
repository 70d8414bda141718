"""Claims written for NVIDIA's DRA driver, unchanged, against this driver deployed as gpu.nvidia.com.

A simulated GB200 tray (Grace, so it has an addressing mode) runs the driver under NVIDIA's driver
name with NVIDIA's DeviceClasses (docs/examples/nvidia/deviceclasses.yaml); GPU 3 holds a MIG device
an administrator made. Every example selector of docs/nvidia-compatibility.md's table goes through
the real scheduler in a claim of each device class its row names, and NVIDIA's config API reaches
the container, or is refused with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.node.nvidia_config import NVIDIA_DRIVER_NAME
from e2e import manifests
from e2e.claims import claim_and_pod, gpu_uuid
from e2e.cluster import ClusterInfo, RestClient
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode, published_devices
from e2e.workloads import delete_pod, pod_claim, wait_running
from tests.nvidia_table import Row, read_table

pytestmark = pytest.mark.e2e

PROFILE = "gb200-tray"
NVIDIA_EXAMPLES = manifests.EXAMPLES / "nvidia"
ADMIN_LABEL = "resource.kubernetes.io/admin-access"  # the namespace label admin access needs
STATIC_MIG = "gpu-3-mig-3g93gb-9-4"  # made by "the administrator" before the tests
CLASS_OF = {"gpu": "gpu.nvidia.com", "mig": "mig.nvidia.com", "existing mig": "mig.nvidia.com"}
CASES = [
    pytest.param(row, kind, id=f"{row.name}-{kind.replace(' ', '-')}")
    for row in read_table()
    for kind in sorted(row.devices)
]


@pytest.fixture(scope="module")
def nvidia_device_classes(cluster: ClusterInfo) -> Iterator[None]:
    rest = cluster.rest()
    with manifests.created(rest, manifests.load(NVIDIA_EXAMPLES / "deviceclasses.yaml")):
        yield


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    nvidia_device_classes: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """The GB200 tray, its driver named gpu.nvidia.com, with a static MIG device on GPU 3."""
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-nvidia"),
        "node-nvidia",
        profile=PROFILE,
        driver_args=["--mig-partitions=all"],
        driver_name=NVIDIA_DRIVER_NAME,
    )
    try:
        node.start()
        simulate(node, "mig-mode", "--gpu=3")
        simulate(node, "create-mig", "--gpu=3", "--profile=3g.93gb", "--start=4")
        rest = cluster.rest()
        wait_until(
            lambda: (
                "uuid"
                in published_devices(rest, node.name, NVIDIA_DRIVER_NAME)
                .get(STATIC_MIG, {})
                .get("attributes", {})
            ),
            timeout_seconds=30,
            waiting_for="the static MIG device to be published",
        )
        yield node
    finally:
        node.remove()


def simulate(node: GpuNode, *args: str) -> str:
    argv = [sys.executable, "-m", "dra_driver", "simulate", *args]
    argv += [f"--simulate={PROFILE}", f"--node-name={node.name}", f"--data-dir={node.driver.paths.data}"]
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize(("row", "kind"), CASES)
def test_each_nvidia_attribute_selects_through_the_real_scheduler(
    rest: RestClient, node: GpuNode, namespace: str, row: Row, kind: str
) -> None:
    manifests.apply(rest, claim_and_pod("pick", CLASS_OF[kind], row.selector, node.name), namespace)

    claim = pod_claim(rest, wait_running(rest, namespace, "pick"), "gpu")

    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == NVIDIA_DRIVER_NAME
    device = published_devices(rest, node.name, NVIDIA_DRIVER_NAME)[result["device"]]
    assert device["attributes"]["type"]["string"] == ("gpu" if kind == "gpu" else "mig")
    published = device["attributes"] if row.kind == "attribute" else device["capacity"]
    assert any(name.startswith(row.name.replace("<N>", "")) for name in published), row.name
    if kind == "existing mig":
        assert result["device"] == STATIC_MIG
    delete_pod(rest, namespace, "pick")


def test_nvidias_time_slicing_example_reaches_both_containers(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, NVIDIA_EXAMPLES / "time-sliced-gpu.yaml", namespace, node_name=node.name)

    claim = pod_claim(rest, wait_running(rest, namespace, "nvidia-time-sliced"), "gpu")

    (result,) = claim["status"]["allocation"]["devices"]["results"]
    spec = json.loads(node.driver.spec_path(claim["metadata"]["uid"]).read_text())
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    env = [variable for device in spec["devices"] for variable in device["containerEdits"].get("env", [])]
    suffix = result["device"].upper().replace("-", "_")
    assert f"DRA_GPU_SHARING_STRATEGY_{suffix}=TimeSlicing" in env
    assert f"DRA_GPU_TIME_SLICE_INTERVAL_{suffix}=Long" in env


def test_a_device_plugin_era_pod_gets_a_gpu_through_nvidias_class(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    """NVIDIA's gpu.nvidia.com class serves nvidia.com/gpu, as NVIDIA's chart sets it."""
    example = manifests.EXAMPLES / "extended-resource.yaml"  # nvidia.com/gpu: 1, and no claim
    manifests.apply_example(rest, example, namespace, node_name=node.name)

    pod = wait_running(rest, namespace, "asks-extended-resource")

    name = pod["status"]["extendedResourceClaimStatus"]["resourceClaimName"]
    claim = rest.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["device"].startswith("gpu-")) == (NVIDIA_DRIVER_NAME, True)
    delete_pod(rest, namespace, "asks-extended-resource")


@pytest.fixture(scope="module")
def default_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    nvidia_device_classes: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """The GB200 tray as a default install names it gpu.nvidia.com: no setting but the driver name."""
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-nvidia-default"),
        "node-nvidia-default",
        profile=PROFILE,
        driver_name=NVIDIA_DRIVER_NAME,
    )
    with node.running():
        yield node


def test_nvidias_admin_access_claim_runs_beside_the_workload_on_a_default_install(
    rest: RestClient, default_node: GpuNode, namespace: str
) -> None:
    """As NVIDIA's users write it: the gpu.nvidia.com class, adminAccess, the GPU's uuid. Kubernetes
    1.37 charges admin access against counters (kubernetes/kubernetes#140729), so this works because
    the default migPartitions (auto) offers no MIG placements beside a full GPU under this name."""
    uuid = gpu_uuid(default_node, 1)
    selector = f'device.attributes["{NVIDIA_DRIVER_NAME}"].uuid == "{uuid}"'
    full = published_devices(rest, default_node.name, NVIDIA_DRIVER_NAME)["gpu-1"]
    assert "consumesCounters" not in full
    manifests.apply(rest, claim_and_pod("workload", "gpu.nvidia.com", selector, default_node.name), namespace)
    workload = pod_claim(rest, wait_running(rest, namespace, "workload"), "gpu")

    admin = f"admin-{namespace}"
    rest.create("/api/v1/namespaces", {"metadata": {"name": admin, "labels": {ADMIN_LABEL: "true"}}})
    try:
        objects = claim_and_pod("diagnostics", "gpu.nvidia.com", selector, default_node.name)
        objects[0]["spec"]["devices"]["requests"][0]["exactly"]["adminAccess"] = True
        manifests.apply(rest, objects, admin)
        diagnostics = pod_claim(rest, wait_running(rest, admin, "diagnostics"), "gpu")
        (held,) = workload["status"]["allocation"]["devices"]["results"]
        (shared,) = diagnostics["status"]["allocation"]["devices"]["results"]
        assert (shared["device"], shared["adminAccess"]) == (held["device"], True)
        assert rest.get(f"/api/v1/namespaces/{namespace}/pods/workload")["status"]["phase"] == "Running"
        delete_pod(rest, admin, "diagnostics")
    finally:
        rest.request("DELETE", f"/api/v1/namespaces/{admin}/pods", query={"gracePeriodSeconds": "0"})
        rest.delete(f"/api/v1/namespaces/{admin}")
    delete_pod(rest, namespace, "workload")
    default_node.wait_idle()
