"""Device metadata (KEP-5304) on a real node: the chart installed with deviceMetadata=true, and a
container that runc started reads the file its claim's CDI spec mounts -- the GPU it was given,
with the PCI address and NUMA node the node's ResourceSlice publishes for it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import ClusterInfo
from e2e.real_node.driver import DRIVER_NAME, DriverRelease, install_driver
from e2e.real_node.gpu_view import allocated_devices, container, create, pod_manifest, wait_running
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

FILE = (
    f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/{DRIVER_NAME}-metadata.json"
)
_END = "== end"
READ_SCRIPT = f"""
cat {FILE}
echo '{_END}'
trap 'exit 0' TERM
while :; do sleep 1; done
"""


@pytest.fixture(scope="module")
def driver(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    release = install_driver(real_cluster, real_node, helm, extra=("deviceMetadata=true",))
    try:
        yield release
    finally:
        release.uninstall()


def printed(api: client.ApiClient, namespace: str, pod: str, timeout: float = 60) -> str:
    wait_running(api, namespace, pod)
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        text: str = core.read_namespaced_pod_log(pod, namespace, container="vm")
        if _END in text:
            return text.partition(_END)[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"{namespace}/{pod} did not print its metadata:\n{text}")
        time.sleep(0.3)


def test_a_container_reads_the_pci_address_of_its_gpu(
    driver: DriverRelease, real_api: client.ApiClient, namespace: str
) -> None:
    numa_1 = 'device.attributes["resource.kubernetes.io"].numaNode == 1'
    template: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "vm-gpu"},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": DRIVER_NAME, "selectors": [{"cel": {"expression": numa_1}}],
        }}]}}},
    }  # fmt: skip
    create(real_api, namespace, template)
    vm = container("vm", ["gpu"], READ_SCRIPT)
    create(real_api, namespace, pod_manifest("vm", {"gpu": {"resourceClaimTemplateName": "vm-gpu"}}, [vm]))

    metadata, _ = json.JSONDecoder().raw_decode(printed(real_api, namespace, "vm"))

    (device,) = allocated_devices(real_api, namespace, "vm")["gpu"]
    (published,) = [d for s in driver.slices() for d in s["spec"].get("devices", []) if d["name"] == device]
    assert metadata["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert metadata["podClaimName"] == "gpu"
    (described,) = metadata["requests"][0]["devices"]
    assert described["name"] == device
    assert described["attributes"] == published["attributes"]
    assert described["attributes"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert described["attributes"]["resource.kubernetes.io/pciBusID"]["string"].startswith("0000:")
