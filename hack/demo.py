"""`make demo`: the driver doing its job on a local cluster, from nothing to cleaned up.

It starts a real control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager), one
simulated DGX H100 node -- the kubelet's own DRA code (the kubelet harness) next to our driver daemon
-- and applies the sample YAML of docs/examples/demo/. Then it prints what a cluster administrator
would look at: the devices the node publishes, what the scheduler allocated to each claim, the CDI
device ids each container received, and the CDI spec the runtime would read. Everything it started
is stopped and removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from e2e.cluster.binaries import ensure_control_plane_binaries
from e2e.cluster.controlplane import ControlPlane
from e2e.gpu_node import GpuNode, published_devices
from e2e.harness import ensure_harness_binary
from e2e.manifests import DEMO, apply, load, of_kind, pinned
from e2e.workloads import (
    allocated_devices,
    cdi_devices,
    delete_pod,
    pod_claim,
    pod_path,
    wait_gone,
    wait_running,
)

NODE = "gpu-node-1"
NAMESPACE = "demo"
# The order tells a story: one GPU, two in one pod, one picked by what it is, one shared by two pods.
SCENARIOS = ("one-gpu.yaml", "two-gpus.yaml", "h100-by-selector.yaml", "shared-claim.yaml")
DRIVER = "gpu.dra-driver.dev"
# DEMO_NVML=mock (`make demo DEMO_NVML=mock`): the driver's NVML backend on the mock libnvidia-ml.so.1
# (hack/mock-nvml, a DGX H100 from NVIDIA's go-nvml mocks) instead of the simulated backend.
MOCK_NVML = "dgxh100" if os.environ.get("DEMO_NVML") == "mock" else None
BACKEND = "NVML on the mock libnvidia-ml.so.1, a DGX H100" if MOCK_NVML else "simulated DGX H100"


def main() -> int:
    started = time.monotonic()
    step("building or reusing the control plane and the kubelet harness (cached outside the repo)")
    binaries = ensure_control_plane_binaries()
    harness = ensure_harness_binary()
    with tempfile.TemporaryDirectory(prefix="dra-driver-demo-") as scratch:
        base = Path(scratch)
        with ControlPlane(binaries, base / "cluster") as control_plane:
            info = control_plane.info
            step(f"Kubernetes {info.kube_version} control plane up at {info.server}")
            node = GpuNode(info, harness, base / "node", NODE, profile="dgx-h100", mock_nvml=MOCK_NVML)
            try:
                node.start()
                run_scenarios(node)
            finally:
                node.remove()
    step(f"done in {time.monotonic() - started:.0f}s; everything it started is gone")
    return 0


def run_scenarios(node: GpuNode) -> None:
    rest = node.rest
    step(f"node {NODE}: kubelet harness + dra-driver ({BACKEND}) registered")
    print_devices(published_devices(rest, NODE))

    rest.create(
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}
    )
    apply(rest, load(DEMO / "deviceclass.yaml"), NAMESPACE)
    pods: list[str] = []
    for scenario in SCENARIOS:
        objects = pinned(load(DEMO / scenario), NODE)
        step(f"kubectl apply -f docs/examples/demo/{scenario}")
        apply(rest, objects, NAMESPACE)
        for pod in of_kind(objects, "Pod"):
            name = pod["metadata"]["name"]
            pods.append(name)
            report_pod(node, wait_running(rest, NAMESPACE, name))

    step("deleting the pods: the kubelet unprepares each claim and the driver removes its CDI spec")
    for name in pods:
        delete_pod(rest, NAMESPACE, name)
    for name in pods:
        wait_gone(rest, pod_path(NAMESPACE, name))
    node.wait_idle()
    print(f"    claims still prepared on {NODE}: {len(node.driver.prepared_claim_uids())}")


def report_pod(node: GpuNode, pod: dict[str, Any]) -> None:
    name = pod["metadata"]["name"]
    print(f"  pod {name}: {pod['status']['phase']}")
    for claim_ref in pod["spec"]["resourceClaims"]:
        claim = pod_claim(node.rest, pod, claim_ref["name"])
        devices = ", ".join(allocated_devices(claim))
        print(f"    claim {claim['metadata']['name']}: allocated {devices}")
        spec_file = node.driver.spec_path(claim["metadata"]["uid"])
        if spec_file.exists():
            print(f"    CDI spec {spec_file.name}:")
            print_spec(json.loads(spec_file.read_text()))
    for container, ids in cdi_devices(pod).items():
        print(f"    container {container} gets CDI devices: {', '.join(ids) or '(none)'}")


def print_devices(devices: dict[str, Any]) -> None:
    gpus = {name: d for name, d in devices.items() if d["attributes"]["type"]["string"] == "gpu"}
    print(f"  {len(devices)} devices: {len(gpus)} full GPUs, {len(devices) - len(gpus)} MIG partitions")
    print(f"  {'device':8} {'product':24} {'memory':>10} {'SMs':>4}  uuid")
    for name, device in sorted(gpus.items(), key=lambda item: int(item[0].rsplit("-", 1)[1])):
        attributes, capacity = device["attributes"], device.get("capacity", {})
        memory = f"{int(capacity['memory']['value']) / 2**30:.1f}Gi"
        sms = capacity.get("multiprocessors", {}).get("value", "?")
        product = attributes["productName"]["string"]
        print(f"  {name:8} {product:24} {memory:>10} {sms:>4}  {attributes['uuid']['string']}")


def print_spec(spec: dict[str, Any]) -> None:
    print(f"      kind {spec['kind']}, cdiVersion {spec['cdiVersion']}")
    for device in spec["devices"]:
        edits = device["containerEdits"]
        nodes = ", ".join(node["path"] for node in edits.get("deviceNodes", []))
        env = ", ".join(edits.get("env", []))
        print(f"      {device['name']}: {nodes}; {env}")
    common = spec.get("containerEdits", {})
    control = ", ".join(node["path"] for node in common.get("deviceNodes", []))
    print(f"      every container: {control}; {', '.join(common.get('env', []))}")


def step(message: str) -> None:
    print(f"\n==> {message}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
