"""The optional node labeller: GPU feature discovery's labels on the node, following its GPUs, and a
device-plugin-era pod that picks the node by product with a nodeSelector."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import manifests
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode
from e2e.workloads import wait_running

pytestmark = pytest.mark.e2e

PRODUCT = "nvidia.com/gpu.product"
COUNT = "nvidia.com/gpu.count"


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-labels"),
        "node-labels",
        driver_args=["--node-labels=true", "--inventory-refresh-seconds=1"],
    )
    with node.running():
        yield node


def labels(rest: RestClient, node: GpuNode) -> dict[str, str]:
    found: dict[str, str] = rest.get(f"/api/v1/nodes/{node.name}")["metadata"].get("labels") or {}
    return found


def wait_label(rest: RestClient, node: GpuNode, key: str, value: str | None) -> None:
    wait_until(
        lambda: labels(rest, node).get(key) == value,
        timeout_seconds=30,
        waiting_for=f"node label {key}={value}",
    )


def simulate(node: GpuNode, *args: str) -> None:
    argv = [sys.executable, "-m", "dra_driver", "simulate", *args]
    argv += [f"--simulate={node.driver.profile}", f"--node-name={node.name}"]
    subprocess.run([*argv, f"--data-dir={node.driver.paths.data}"], check=True, capture_output=True)


def test_a_device_plugin_era_pod_selects_the_node_by_product(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    wait_label(rest, node, PRODUCT, "NVIDIA-H100-80GB-HBM3")
    found = labels(rest, node)
    assert found[COUNT] == "8"
    assert found["nvidia.com/gpu.present"] == "true"
    assert found["nvidia.com/gpu.family"] == "hopper"
    assert found["kubernetes.io/hostname"] == node.name  # the node's other labels are left alone

    pod: JsonObject = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "by-product"},
        "spec": {
            "nodeSelector": {PRODUCT: "NVIDIA-H100-80GB-HBM3"},
            "containers": [{"name": "app", "image": "ubuntu:24.04"}],
        },
    }
    manifests.apply(rest, [pod], namespace)

    assert wait_running(rest, namespace, "by-product")["spec"]["nodeName"] == node.name


def test_labels_follow_mig_changes_and_lost_gpus(rest: RestClient, node: GpuNode) -> None:
    wait_label(rest, node, COUNT, "8")

    simulate(node, "mig-mode", "--gpu=6")
    simulate(node, "create-mig", "--gpu=6", "--profile=3g.40gb", "--start=4")
    wait_label(rest, node, "nvidia.com/mig-3g.40gb.count", "1")
    assert labels(rest, node)["nvidia.com/mig-3g.40gb.product"] == "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"

    simulate(node, "xid", "--gpu=7", "--xid=79")  # fallen off the bus
    wait_label(rest, node, COUNT, "7")
    simulate(node, "recover", "--gpu=7")
    wait_label(rest, node, COUNT, "8")
