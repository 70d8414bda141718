"""ComputeDomains in the host-managed IMEX mode (NVIDIA's HostManagedIMEXDaemon) on two simulated
GB200 trays of one NVLink clique.

The chart's objects are those `helm install --set featureGates.HostManagedIMEXDaemon=true` creates,
the controller and the node drivers run with `--host-managed-imex=true`: no IMEX DaemonSet is made,
no IMEX daemon pod runs (so no DaemonSet controller and no stand-in runtime are started here), and a
workload's pod gets its channel from the node once the host's own nvidia-imex answers READY. Each
simulated tray's "host nvidia-imex service" is a flag of its simulated state, which the failure test
stops (`dra-driver simulate host-imex --state stopped`) and starts again.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from dra_driver.computedomain.plugin import SIMULATED_CHANNEL_MAJOR
from dra_driver.simulated.gpus import SimulatedBackend
from e2e import manifests
from e2e.cluster import ApiError, ClusterInfo, RestClient
from e2e.cluster.credentials import write_kubeconfig
from e2e.cluster.tokens import mint_service_account_token
from e2e.compute_domains import (
    CD_DRIVER,
    CDI_ANNOTATION,
    DRIVER,
    LABEL,
    ControllerProcess,
    domains_path,
    wait,
)
from e2e.gpu_node import GpuNode, published_devices
from e2e.workloads import pod_event_saying

CLUSTER_UUID = "0d5e8f2a-7c41-4b9e-a3d6-5f1e2c3b4a69"
TRAYS = ("hm-tray-1", "hm-tray-2")
PROFILE = "gb200-tray"
GATE = "featureGates.HostManagedIMEXDaemon=true"
CONTROLLER_ACCOUNT = "cd-dra-driver-gpu-compute-domain-controller"

_PATHS = {
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


@dataclass
class HostManagedRack:
    rest: RestClient
    nodes: dict[str, GpuNode]
    driver_namespace: str
    chart: list[dict[str, Any]]  # what the chart rendered for the mode, as created here

    def host_imex(self, node: str, state: str) -> None:
        """What `dra-driver simulate host-imex --state <state>` does on the node."""
        driver = self.nodes[node].driver
        SimulatedBackend(PROFILE, node, driver.paths.data).set_host_imex(state)  # type: ignore[arg-type]


def _create(rest: RestClient, collection: str, obj: dict[str, Any]) -> bool:
    """Create ``obj``; a CRD of the same name still being deleted (another module's) is waited out.
    Returns whether this call created it (an existing one that is not going is used as it is)."""
    name = obj["metadata"]["name"]
    try:
        rest.create(collection, obj)
        return True
    except ApiError as error:
        if error.status != 409:
            raise

    def created() -> bool:
        try:
            current = rest.get(f"{collection}/{name}")
        except ApiError as error:
            if error.status != 404:
                raise
            rest.create(collection, obj)
            return True
        if not current["metadata"].get("deletionTimestamp"):
            raise AssertionError(f"{collection}/{name} exists and is not being deleted: a leftover")
        return False

    return bool(wait(created, timeout=120, what=f"{name} to be created anew"))


@pytest.fixture(scope="module")
def rack(
    cluster: ClusterInfo, kubelet_harness_binary: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HostManagedRack]:
    rest = cluster.rest()
    base = tmp_path_factory.mktemp("hm")  # short: socket paths have a 107-byte limit
    created: list[str] = []
    stops: list[Any] = []
    driver_namespace = f"hm-driver-{uuid.uuid4().hex[:6]}"
    try:
        rest.create("/api/v1/namespaces", {"metadata": {"name": driver_namespace}})
        created.append(f"/api/v1/namespaces/{driver_namespace}")
        chart = [
            obj
            for obj in manifests.rendered_chart("cd", driver_namespace, f"driverName={DRIVER}", GATE)
            if obj["kind"] in _PATHS
            and (obj["kind"] == "CustomResourceDefinition" or "compute-domain" in obj["metadata"]["name"])
        ]
        for obj in chart:
            collection = _PATHS[obj["kind"]].format(ns=driver_namespace)
            _create(rest, collection, obj)
            created.append(f"{collection}/{obj['metadata']['name']}")
        for crd in ("computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com"):
            manifests.wait_established(rest, crd)

        # The controller runs with the chart's RBAC for the mode: no DaemonSets, no cliques.
        with cluster.api_client() as api:
            token = mint_service_account_token(
                api, driver_namespace, CONTROLLER_ACCOUNT, expiration_seconds=7200
            )
        kubeconfig = base / "controller.kubeconfig"
        write_kubeconfig(
            kubeconfig,
            server=cluster.server,
            ca_certificate=cluster.ca_file.read_bytes(),
            user=CONTROLLER_ACCOUNT,
            token=token,
        )
        controller = ControllerProcess(
            kubeconfig, driver_namespace, base / "controller.log", 15.0, "a", ["--host-managed-imex=true"]
        )
        controller.start()
        stops.append(controller.stop)
        wait(lambda: controller.leading, timeout=60, what="the controller to lead")

        nodes: dict[str, GpuNode] = {}
        for name in TRAYS:
            node = GpuNode(
                cluster,
                kubelet_harness_binary,
                base / name.removeprefix("hm-tray-"),
                name,
                profile=PROFILE,
                driver_args=[
                    f"--driver-name={DRIVER}",
                    f"--simulate-fabric={CLUSTER_UUID}/1",
                    "--host-managed-imex=true",
                ],
            )
            stops.append(node.remove)
            node.start()
            nodes[name] = node
        yield HostManagedRack(rest, nodes, driver_namespace, chart)
    finally:
        for stop in reversed(stops):
            stop()
        for path in reversed(created):
            rest.delete(path)


def _domain(name: str, num_nodes: int, template: str, mode: str = "Single") -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {
            "numNodes": num_nodes,
            "channel": {"resourceClaimTemplate": {"name": template}, "allocationMode": mode},
        },
    }


def _worker(name: str, template: str, node: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "ctr",
                "image": "ubuntu:24.04",
                "command": ["sh", "-c", "ls -la /dev/nvidia-caps-imex-channels; sleep 9999"],
                "resources": {"claims": [{"name": "channel"}]},
            }
        ],
        "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
    }
    if node:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _pod(rest: RestClient, namespace: str, name: str) -> dict[str, Any]:
    return rest.get(f"/api/v1/namespaces/{namespace}/pods/{name}")


def _running(rest: RestClient, namespace: str, name: str) -> dict[str, Any] | None:
    pod = _pod(rest, namespace, name)
    return pod if pod.get("status", {}).get("phase") == "Running" else None


def _items(rest: RestClient, path: str, **query: str) -> list[dict[str, Any]]:
    """The objects listed; a CRD's storage still initializing (429) is asked again."""

    def listed() -> list[dict[str, Any]] | None:
        try:
            items: list[dict[str, Any]] = rest.request("GET", path, query=query or None)["items"]
        except ApiError as error:
            if error.status != 429:
                raise
            return None
        return items

    deadline = time.monotonic() + 30
    while (items := listed()) is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert items is not None, f"{path}: still 429 after 30 s"
    return items


def test_workers_get_their_channels_with_no_imex_daemonset_and_the_domain_is_ready(
    rack: HostManagedRack, namespace: str
) -> None:
    rest = rack.rest
    # The chart left out the daemons' account, Role and DeviceClass, and the controller may not
    # touch DaemonSets or ComputeDomainCliques.
    kinds_and_names = {(o["kind"], o["metadata"]["name"]) for o in rack.chart}
    assert ("ServiceAccount", "compute-domain-daemon") not in kinds_and_names
    assert ("DeviceClass", "compute-domain-daemon.nvidia.com") not in kinds_and_names
    (role,) = [o for o in rack.chart if o["kind"] == "Role" and o["metadata"]["name"] == CONTROLLER_ACCOUNT]
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"leases"}
    # Each tray publishes its channel and no IMEX daemon device.
    for node in TRAYS:
        devices = wait(lambda node=node: published_devices(rest, node, CD_DRIVER), timeout=30, what="slices")
        assert set(devices) == {"channel-0"}

    # allocationMode All asked for: the host's IMEX domain gives channel 0 alone, as NVIDIA's does.
    rest.create(domains_path(namespace), _domain("hm", 2, "hm-channel", mode="All"))
    for n in (1, 2):
        rest.create(f"/api/v1/namespaces/{namespace}/pods", _worker(f"worker-{n}", "hm-channel"))

    workers = [
        wait(lambda n=n: _running(rest, namespace, f"worker-{n}"), timeout=90, what=f"worker-{n} running")
        for n in (1, 2)
    ]
    assert sorted(w["spec"]["nodeName"] for w in workers) == sorted(TRAYS)  # one channel per node
    for pod in workers:
        (claim_status,) = pod["status"]["resourceClaimStatuses"]
        claim = rest.get(
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{claim_status['resourceClaimName']}"
        )
        (cdi_id,) = yaml.safe_load(pod["metadata"]["annotations"][CDI_ANNOTATION])["ctr"]
        assert cdi_id == f"k8s.{CD_DRIVER}/claim={claim['metadata']['uid']}-channel-0"
        spec_file = rack.nodes[pod["spec"]["nodeName"]].driver.paths.cdi / (
            f"k8s.{CD_DRIVER}-claim_{claim['metadata']['uid']}.json"
        )
        (device,) = json.loads(spec_file.read_text())["devices"]
        assert device["containerEdits"]["deviceNodes"] == [
            {
                "path": "/dev/nvidia-caps-imex-channels/channel0",
                "type": "c",
                "major": SIMULATED_CHANNEL_MAJOR,
                "minor": 0,
            }
        ]

    domain = rest.get(domains_path(namespace, "hm"))
    (ready,) = domain["status"]["conditions"]
    assert (domain["status"]["status"], ready["reason"]) == ("Ready", "HostManagedIMEX")
    assert not domain["status"].get("nodes")  # no daemons of ours to list
    # Nothing of the driver-managed mode: no DaemonSet, no daemon template, no clique, no node label.
    assert _items(rest, f"/apis/apps/v1/namespaces/{rack.driver_namespace}/daemonsets") == []
    assert (
        _items(rest, f"/apis/resource.k8s.io/v1/namespaces/{rack.driver_namespace}/resourceclaimtemplates")
        == []
    )
    cliques = f"/apis/resource.nvidia.com/v1beta1/namespaces/{rack.driver_namespace}/computedomaincliques"
    assert _items(rest, cliques) == []
    assert _items(rest, "/api/v1/nodes", labelSelector=LABEL) == []


def test_a_worker_waits_with_the_reason_while_its_hosts_imex_daemon_is_stopped(
    rack: HostManagedRack, namespace: str
) -> None:
    rest = rack.rest
    node = TRAYS[0]
    rack.host_imex(node, "stopped")
    try:
        rest.create(domains_path(namespace), _domain("hm-down", 1, "hm-down-channel"))
        rest.create(f"/api/v1/namespaces/{namespace}/pods", _worker("worker", "hm-down-channel", node))
        reason = (
            f"host nvidia-imex daemon readiness check failed on node {node}: error running nvidia-imex-ctl "
            "(socket '/etc/nvidia-imex/imex_ctrl.sock'): the host's nvidia-imex service is not running"
        )
        event = wait(
            lambda: pod_event_saying(rest, namespace, "worker", reason), timeout=90, what="the reason"
        )
        assert "`dra-driver simulate host-imex --state ready` starts it" in event["message"]
        assert _pod(rest, namespace, "worker")["status"].get("phase") == "Pending"
        # The domain itself is Ready: the controller leaves each host's daemon to its node's check.
        assert rest.get(domains_path(namespace, "hm-down"))["status"]["status"] == "Ready"
    finally:
        rack.host_imex(node, "ready")
    # The service is back: the kubelet's next prepare gets the channel.
    running = wait(lambda: _running(rest, namespace, "worker"), timeout=90, what="the worker running")
    assert running["spec"]["nodeName"] == node
