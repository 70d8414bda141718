"""Device metadata (KEP-5304) through the real control plane: docs/examples/device-metadata.yaml on a
simulated DGX H100 whose driver runs with --device-metadata.

The pod's claim is made from a template and selects a GPU by the standard
``resource.kubernetes.io/numaNode``; what is checked is what the kubelet hands the runtime (the
container's CDI ids), the mount those ids resolve to in the claim's spec, and the file behind it:
the GPU the scheduler allocated, with the PCI address and NUMA node the simulator gives that GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dra_driver.devices.types import Gpu
from dra_driver.resources.device_names import gpu_device_name
from e2e import manifests
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode
from e2e.workloads import allocated_devices, cdi_devices, delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.e2e

EXAMPLE = manifests.EXAMPLES / "device-metadata.yaml"
CONTAINER_FILE = (
    f"/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/{DRIVER_NAME}-metadata.json"
)


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """This module's DGX H100 (GPUs 4-7 on NUMA node 1), its driver writing device metadata."""
    name = "node-device-metadata"
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp(name),
        name,
        driver_args=["--device-metadata"],
    )
    with node.running():
        yield node


def spec_mounts(node: GpuNode, cdi_id: str) -> list[dict[str, Any]]:
    """The mounts the CDI device ``cdi_id`` (``<kind>=<name>``) gives a container, from its spec file."""
    _, _, name = cdi_id.partition("=")
    uid = name[:36]  # a claim UID (the spec's file name and every device name start with it)
    spec: JsonObject = json.loads(node.driver.spec_path(uid).read_text())
    (device,) = [d for d in spec["devices"] if d["name"] == name]
    mounts: list[dict[str, Any]] = device["containerEdits"].get("mounts", [])
    return mounts


def first_object(path: Path) -> JsonObject:
    obj, _ = json.JSONDecoder().raw_decode(path.read_text())
    assert isinstance(obj, dict)
    return obj


def test_a_pod_reads_the_pci_address_and_numa_node_of_the_gpu_it_got(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, EXAMPLE, namespace, node_name=node.name)
    pod = wait_running(rest, namespace, "pci-address")
    claim = pod_claim(rest, pod, "gpu")
    (device,) = allocated_devices(claim)
    gpus: dict[str, Gpu] = {gpu_device_name(g.minor): g for g in node.driver.simulated_gpus().gpus}
    assert gpus[device].numa_node == 1  # the claim's selector, as the scheduler applied it

    # What the runtime gets: one CDI id, whose device mounts the request's file read-only.
    (ids,) = cdi_devices(pod).values()
    (mount,) = [m for cdi_id in ids for m in spec_mounts(node, cdi_id)]
    assert (mount["containerPath"], mount["options"]) == (CONTAINER_FILE, ["ro", "bind"])
    host_file = Path(mount["hostPath"])
    assert host_file.is_relative_to(node.driver.paths.plugins / DRIVER_NAME / "dra-device-metadata")

    metadata = first_object(host_file)
    assert metadata["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert metadata["metadata"]["uid"] == claim["metadata"]["uid"]
    assert metadata["podClaimName"] == "gpu"
    (described,) = metadata["requests"][0]["devices"]
    assert (described["driver"], described["pool"], described["name"]) == (DRIVER_NAME, node.name, device)
    attributes = described["attributes"]
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": gpus[device].pci_bus_id}
    assert attributes["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert attributes["uuid"] == {"string": gpus[device].uuid}

    delete_pod(rest, namespace, "pci-address")
    wait_until(lambda: not host_file.exists(), timeout_seconds=60, waiting_for="the metadata file to go")
