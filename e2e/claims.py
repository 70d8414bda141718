"""Claims for one particular GPU of a test node, and pods using them: what the health and maintenance
tests need to aim at a GPU they tainted, cordoned or share; and a claim of one device of a class
that a CEL selector picks, with its pod on one node."""

from __future__ import annotations

from typing import Any

from e2e import manifests
from e2e.cluster import JsonObject, RestClient
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode
from e2e.manifests import collection

GPU_CLASS = DRIVER_NAME  # docs/examples/demo/deviceclass.yaml
TIMEOUT_S = 60.0


def gpu_uuid(node: GpuNode, minor: int) -> str:
    (gpu,) = [gpu for gpu in node.driver.simulated_gpus().gpus if gpu.minor == minor]
    return gpu.uuid


def claim_for_gpu(name: str, uuid: str, tolerations: list[JsonObject] | None = None) -> JsonObject:
    """A claim for exactly the GPU with `uuid` (CEL cannot name a device, its attributes can)."""
    exactly: JsonObject = {
        "deviceClassName": GPU_CLASS,
        "selectors": [{"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].uuid == "{uuid}"'}}],
    }
    if tolerations:
        exactly["tolerations"] = tolerations
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def pod_using(name: str, claim: str) -> JsonObject:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
            "containers": [
                {"name": "app", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }


def run_on_gpu(
    rest: RestClient,
    node: GpuNode,
    namespace: str,
    name: str,
    uuid: str,
    tolerations: list[JsonObject] | None = None,
) -> None:
    """A claim `name` for GPU `uuid` and a pod `name` using it, kept to the node."""
    objects = [claim_for_gpu(name, uuid, tolerations), pod_using(name, name)]
    manifests.apply(rest, manifests.pinned(objects, node.name), namespace)


def wait_unschedulable(rest: RestClient, namespace: str, name: str) -> JsonObject:
    """Until the scheduler has found no place for the pod (its claims cannot be allocated)."""

    def unschedulable(pod: JsonObject) -> bool:
        conditions = pod.get("status", {}).get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    return rest.wait_for(collection("Pod", namespace), name, unschedulable, timeout_seconds=TIMEOUT_S)


def claim_of(rest: RestClient, namespace: str, name: str) -> JsonObject:
    return rest.get(f"{collection('ResourceClaim', namespace)}/{name}")


def claim_and_pod(name: str, device_class: str, selector: str | None, node: str) -> list[JsonObject]:
    """A claim for one device of ``device_class`` (that ``selector`` picks, if given), and a pod
    using it that may only go to ``node``."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selector is not None:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
            "containers": [
                {"name": "app", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "gpu"}]}}
            ],
        },
    }
    return manifests.pinned([claim, pod], node)
