"""Workload pods that print what their container sees of the GPUs, and the parsed view.

The container (the workload image: a busybox shell and coreutils) prints its NVIDIA device nodes
with their numbers, its DRA_GPU_UUID_* variables and the driver libraries mounted into it, then
waits to be stopped; the test reads that through `kubectl logs`' API (the API server asks the
kubelet, which reads containerd's log) and checks it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from e2e.realnode.images import IMAGES, chart_app_version

LIBRARY_DIR = "/usr/lib/x86_64-linux-gnu"
_END = "== end"

# busybox stat: %t and %T are the major and minor number in hex.
VIEW_SCRIPT = f"""
echo '== devices'
for node in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -c "$node" ] && stat -c '%n %t %T' "$node"
done
echo '== env'
env | grep '^DRA_GPU_UUID_' | sort
echo '== libraries'
ls {LIBRARY_DIR} 2>/dev/null
echo '{_END}'
trap 'exit 0' TERM
while :; do sleep 1; done
"""


@dataclass(frozen=True)
class GpuView:
    devices: Mapping[str, tuple[int, int]]  # /dev/nvidia0 -> (195, 0)
    uuids: Mapping[str, str]  # DRA_GPU_UUID_GPU_0 -> GPU-...
    libraries: frozenset[str] = field(default_factory=frozenset)

    @property
    def gpu_nodes(self) -> dict[str, tuple[int, int]]:
        """The per-GPU nodes /dev/nvidia<minor> (not the control nodes)."""
        return {p: n for p, n in self.devices.items() if p.removeprefix("/dev/nvidia").isdigit()}

    @property
    def cap_nodes(self) -> dict[str, tuple[int, int]]:
        return {p: n for p, n in self.devices.items() if p.startswith("/dev/nvidia-caps/")}


def parse_view(text: str) -> GpuView:
    section = ""
    devices: dict[str, tuple[int, int]] = {}
    uuids: dict[str, str] = {}
    libraries: set[str] = set()
    for line in text.splitlines():
        if line.startswith("== "):
            section = line[3:]
            continue
        if not line.strip():
            continue
        if section == "devices":
            path, major, minor = line.split()
            devices[path] = (int(major, 16), int(minor, 16))
        elif section == "env":
            name, _, value = line.partition("=")
            uuids[name] = value
        elif section == "libraries":
            libraries.add(line.strip())
    return GpuView(devices=devices, uuids=uuids, libraries=frozenset(libraries))


def workload_image() -> str:
    return f"{IMAGES['workload']}:{chart_app_version()}"


def container(name: str, claims: Sequence[str], script: str = VIEW_SCRIPT) -> dict[str, Any]:
    return {
        "name": name,
        "image": workload_image(),
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", script],
        "resources": {"claims": [{"name": claim} for claim in claims]},
    }


def pod_manifest(
    name: str,
    claims: Mapping[str, Mapping[str, str]],
    containers: Sequence[dict[str, Any]],
) -> dict[str, Any]:
    """`claims`: pod claim name -> {"resourceClaimName": ...} or {"resourceClaimTemplateName": ...}."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "automountServiceAccountToken": False,
            "resourceClaims": [{"name": claim, **source} for claim, source in claims.items()],
            "containers": list(containers),
        },
    }


def gpu_claim_template(name: str, count: int = 1, device_class: str = "gpu.dra-driver.dev") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [_request(device_class, count)]}}},
    }


def gpu_claim(name: str, count: int = 1, device_class: str = "gpu.dra-driver.dev") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [_request(device_class, count)]}},
    }


def _request(device_class: str, count: int, selector: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {
        "deviceClassName": device_class,
        "allocationMode": "ExactCount",
        "count": count,
    }
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    return {"name": "gpu", "exactly": exactly}


def create(api: client.ApiClient, namespace: str, manifest: dict[str, Any]) -> None:
    kind = manifest["kind"]
    if kind == "Pod":
        client.CoreV1Api(api).create_namespaced_pod(namespace, manifest)
        return
    resource = client.ResourceV1Api(api)
    if kind == "ResourceClaim":
        resource.create_namespaced_resource_claim(namespace, manifest)
    elif kind == "ResourceClaimTemplate":
        resource.create_namespaced_resource_claim_template(namespace, manifest)
    else:
        raise ValueError(f"no create for {kind}")


def wait_running(api: client.ApiClient, namespace: str, name: str, timeout: float = 120) -> client.V1Pod:
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        pod = core.read_namespaced_pod(name, namespace)
        if pod.status.phase == "Running":
            return pod
        if pod.status.phase in ("Failed", "Succeeded") or time.monotonic() > deadline:
            events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
            said = "; ".join(f"{e.reason}: {e.message}" for e in events.items)
            raise AssertionError(f"pod {namespace}/{name} is {pod.status.phase}, not Running: {said}")
        time.sleep(0.3)


def view_of(
    api: client.ApiClient, namespace: str, pod: str, container_name: str, timeout: float = 60
) -> GpuView:
    """What `container_name` printed, once it has printed all of it (kubectl logs)."""
    wait_running(api, namespace, pod)
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        text = core.read_namespaced_pod_log(pod, namespace, container=container_name)
        if _END in text:
            return parse_view(text)
        if time.monotonic() > deadline:
            raise AssertionError(f"{namespace}/{pod}/{container_name} did not print its view:\n{text}")
        time.sleep(0.3)


def allocated_devices(api: client.ApiClient, namespace: str, pod: str) -> dict[str, list[str]]:
    """Pod claim name -> the devices the scheduler allocated (its ResourceClaim's status)."""
    core = client.CoreV1Api(api)
    resource = client.ResourceV1Api(api)
    found = core.read_namespaced_pod(pod, namespace)
    generated = {s.name: s.resource_claim_name for s in found.status.resource_claim_statuses or []}
    result = {}
    for pod_claim in found.spec.resource_claims or []:
        name = pod_claim.resource_claim_name or generated[pod_claim.name]
        claim = resource.read_namespaced_resource_claim(name, namespace)
        result[pod_claim.name] = [r.device for r in claim.status.allocation.devices.results]
    return result
