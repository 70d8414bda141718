"""What a user checks of a GPU workload: its pod's state, the claim the scheduler allocated, the CDI
device ids the kubelet handed to the runtime, and the CDI spec those ids resolve to on the node."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from dra_driver.cdi.spec import cdi_device_id, uuid_env_name
from dra_driver.cdi.validate import validate_spec
from dra_driver.devices.types import Inventory
from dra_driver.resources.device_names import gpu_device_name, mig_device_name
from e2e.cluster import ApiError, JsonObject, RestClient
from e2e.cluster.features import kube_minor
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode, published_devices
from e2e.manifests import collection

# Where the kubelet harness records the CDI ids each container would get (its README.md).
CDI_DEVICES_ANNOTATION = "dra-harness.dra-driver.dev/cdi-devices"
_DEFAULT_TIMEOUT = 60.0


def pod_path(namespace: str, name: str) -> str:
    return f"{collection('Pod', namespace)}/{name}"


def wait_running(
    rest: RestClient, namespace: str, name: str, timeout_seconds: float = _DEFAULT_TIMEOUT
) -> JsonObject:
    return rest.wait_for(
        collection("Pod", namespace),
        name,
        lambda pod: pod.get("status", {}).get("phase") == "Running",
        timeout_seconds=timeout_seconds,
    )


def wait_gone(rest: RestClient, path: str, timeout_seconds: float = _DEFAULT_TIMEOUT) -> None:
    def gone() -> bool:
        try:
            rest.get(path)
        except ApiError as error:
            if error.status == 404:
                return True
            raise
        return False

    wait_until(gone, timeout_seconds=timeout_seconds, waiting_for=f"{path} to be deleted")


def delete_pod(rest: RestClient, namespace: str, name: str) -> None:
    """A graceful deletion, as `kubectl delete pod` does; returns once the kubelet completed it."""
    path = pod_path(namespace, name)
    rest.delete(path)
    wait_gone(rest, path)


def pod_event_saying(rest: RestClient, namespace: str, pod: str, text: str) -> JsonObject | None:
    """The pod's first event whose message contains ``text``: a failed prepare is the kubelet's
    FailedPrepareDynamicResources, or, with binding conditions (on by default from 1.36) on a device
    made at prepare, the scheduler's event of a binding the plugin failed; both carry its reason."""
    query = {"fieldSelector": f"involvedObject.kind=Pod,involvedObject.name={pod}"}
    items: list[JsonObject] = rest.request("GET", f"/api/v1/namespaces/{namespace}/events", query=query)[
        "items"
    ]
    return next((item for item in items if text in (item.get("message") or "")), None)


def cdi_devices(pod: Mapping[str, Any]) -> dict[str, list[str]]:
    """The CDI device ids, by container, that the kubelet passed to the container runtime."""
    annotations = pod["metadata"].get("annotations") or {}
    devices: dict[str, list[str]] = json.loads(annotations[CDI_DEVICES_ANNOTATION])
    return devices


def kubelet_repeats_cdi_ids(kube_version: str) -> bool:
    """Whether this release's kubelet may hand a container the same CDI id twice. Before 1.37 the
    kubelet's DRA manager appends a claim's devices each time NodePrepareResources answers for it,
    without clearing those of an earlier answer: a claim prepared again (two pods sharing it started
    at once, or a kubelet restart) gives its containers every id twice. 1.37 clears them first
    (ClaimInfo.resetDevices in pkg/kubelet/cm/dra); the driver's answers are the same either way."""
    return kube_minor(kube_version) < 37


def distinct_cdi_devices(pod: Mapping[str, Any], kube_version: str) -> dict[str, list[str]]:
    """cdi_devices(pod), with the kubelet's repeats (kubelet_repeats_cdi_ids) dropped on the releases
    that have them; on 1.37 and later exactly what the runtime was handed."""
    devices = cdi_devices(pod)
    if not kubelet_repeats_cdi_ids(kube_version):
        return devices
    return {container: list(dict.fromkeys(ids)) for container, ids in devices.items()}


def pod_claim(rest: RestClient, pod: Mapping[str, Any], claim_ref: str) -> JsonObject:
    """The ResourceClaim behind the pod's `resourceClaims[].name == claim_ref`, template-made or not."""
    namespace = pod["metadata"]["namespace"]
    (reference,) = [r for r in pod["spec"]["resourceClaims"] if r["name"] == claim_ref]
    name = reference.get("resourceClaimName")
    if name is None:
        statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
        (name,) = [s["resourceClaimName"] for s in statuses if s["name"] == claim_ref]
    return rest.get(f"{collection('ResourceClaim', namespace)}/{name}")


def allocated_devices(claim: Mapping[str, Any]) -> list[str]:
    """The devices of our driver the scheduler allocated to the claim, in allocation order."""
    results = claim["status"]["allocation"]["devices"]["results"]
    return [result["device"] for result in results if result["driver"] == DRIVER_NAME]


def expected_cdi_ids(claim: Mapping[str, Any]) -> list[str]:
    uid = claim["metadata"]["uid"]
    return [cdi_device_id(DRIVER_NAME, uid, device) for device in allocated_devices(claim)]


def hardware_behind(inventory: Inventory, device: str) -> tuple[str, list[str]]:
    """The UUID and the device nodes of the GPU or MIG device that a published device name stands for."""
    for gpu in inventory.gpus:
        if device == gpu_device_name(gpu.minor):
            return gpu.uuid, [gpu.device_node.path]
        for mig in gpu.mig_devices:
            if device == mig_device_name(gpu.minor, mig.profile, mig.profile_id, mig.placement.start):
                return mig.uuid, [gpu.device_node.path, *(node.path for node in mig.cap_nodes)]
    raise AssertionError(f"no GPU or MIG device {device} on the node: {inventory}")


def check_cdi_spec(node: GpuNode, claim: Mapping[str, Any]) -> JsonObject:
    """The claim's CDI spec on the node: present, valid, and giving the container, for every allocated
    device, exactly the hardware behind it -- its device nodes and its UUID. Returns the spec."""
    uid = claim["metadata"]["uid"]
    path = node.driver.spec_path(uid)
    assert path.is_file(), f"no CDI spec for claim {claim['metadata']['name']} at {path}"
    spec: JsonObject = json.loads(path.read_text())
    validate_spec(spec)
    assert spec["kind"] == f"k8s.{DRIVER_NAME}/claim"
    devices_in_spec = {device["name"]: device["containerEdits"] for device in spec["devices"]}
    inventory = node.driver.simulated_gpus()
    published = published_devices(node.rest, node.name)
    for device in allocated_devices(claim):
        edits = devices_in_spec[f"{uid}-{device}"]
        uuid, device_nodes = hardware_behind(inventory, device)
        assert [node["path"] for node in edits["deviceNodes"]] == device_nodes
        assert f"{uuid_env_name(device)}={uuid}" in edits["env"]
        attributes = published.get(device, {}).get("attributes", {})
        if attributes.get("type") == {"string": "gpu"}:  # the GPU the scheduler was shown is the one given
            assert attributes["uuid"] == {"string": uuid}
    return spec
