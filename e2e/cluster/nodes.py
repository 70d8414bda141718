"""Nodes without a kubelet: API objects that the scheduler treats as Ready GPU machines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from kubernetes import client

# What a GPU node carries once the kubelet and NVIDIA's GPU feature discovery have labelled it;
# node selectors and DeviceClass selectors in the tests match on these.
GPU_NODE_LABELS: Mapping[str, str] = {
    "kubernetes.io/os": "linux",
    "kubernetes.io/arch": "amd64",
    "nvidia.com/gpu.present": "true",
}

# Room for any test pod; the scheduler filters on allocatable before it looks at devices.
NODE_CAPACITY: Mapping[str, str] = {
    "cpu": "64",
    "memory": "512Gi",
    "ephemeral-storage": "1Ti",
    "pods": "110",
}


def fake_node_status() -> dict[str, Any]:
    """A status as a healthy kubelet reports it: Ready, no pressure, the capacity above."""
    healthy = {
        "Ready": ("True", "KubeletReady"),
        "MemoryPressure": ("False", "KubeletHasSufficientMemory"),
        "DiskPressure": ("False", "KubeletHasNoDiskPressure"),
        "PIDPressure": ("False", "KubeletHasSufficientPID"),
    }
    return {
        "conditions": [
            {"type": kind, "status": status, "reason": reason, "message": "fake node: no kubelet"}
            for kind, (status, reason) in healthy.items()
        ],
        "capacity": dict(NODE_CAPACITY),
        "allocatable": dict(NODE_CAPACITY),
    }


def create_fake_node(
    api: client.ApiClient, name: str, labels: Mapping[str, str] | None = None
) -> client.V1Node:
    """Creates a Ready, untainted Node `name` with GPU_NODE_LABELS (plus hostname) and `labels` on top.

    Nothing taints it: the TaintNodesByCondition admission plugin is off and no node-lifecycle
    controller runs. Status is a subresource, so it is written in a second request, as a kubelet would.
    """
    core = client.CoreV1Api(api)
    all_labels = {**GPU_NODE_LABELS, "kubernetes.io/hostname": name, **(labels or {})}
    core.create_node(
        client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=all_labels), spec=client.V1NodeSpec())
    )
    updated: client.V1Node = core.patch_node_status(
        name, {"status": fake_node_status()}, _content_type="application/merge-patch+json"
    )
    return updated


class FakeNodeFactory(Protocol):
    """The `fake_node` fixture: create_fake_node bound to a client, with clean-up after the test."""

    def __call__(self, name: str, labels: Mapping[str, str] | None = None) -> client.V1Node: ...
