"""ComputeDomains on four simulated GB200 NVL72 trays in two NVLink cliques (see e2e/compute_domains.py
for what is real here and what plays the container runtime of the IMEX daemon pods)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from dra_driver.computedomain.plugin import SIMULATED_CHANNEL_MAJOR
from e2e import manifests
from e2e.cluster import ApiError, ClusterInfo, RestClient
from e2e.cluster.binaries import ControlPlaneBinaries
from e2e.cluster.controlplane import free_ports
from e2e.cluster.credentials import write_kubeconfig
from e2e.cluster.tokens import mint_service_account_token
from e2e.compute_domains import (
    CD_DRIVER,
    CDI_ANNOTATION,
    DRIVER,
    IMEX_CHANNEL_MAJOR,
    LABEL,
    ControllerProcess,
    DaemonPodRunner,
    ExtraControllers,
    domains_path,
    nvml_tray_wrapper,
    wait,
)
from e2e.gpu_node import GpuNode

EXAMPLES = manifests.EXAMPLES / "compute-domain"
CLUSTER_UUID = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b"
CLIQUES = {"cd-tray-a1": 1, "cd-tray-a2": 1, "cd-tray-b1": 2, "cd-tray-b2": 2}
NVML_TRAYS = {"cd-tray-a1", "cd-tray-a2"}  # on the mock NVML; the others on the simulator
NO_FABRIC_NODE = "cd-h100"
READY_TIMEOUT = 15.0  # the controller's daemon readiness timeout in this module


@dataclass
class Rack:
    rest: RestClient
    nodes: dict[str, GpuNode]
    runner: DaemonPodRunner
    driver_namespace: str
    controllers: list[ControllerProcess]

    def clique_of(self, node: str) -> str:
        return f"{CLUSTER_UUID}.{CLIQUES[node]}"


# Where the chart's ComputeDomain objects are created, by kind.
_PATHS = {
    "CustomResourceDefinition": "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    "DeviceClass": "/apis/resource.k8s.io/v1/deviceclasses",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts",
    "ClusterRole": "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    "ClusterRoleBinding": "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
}


def _chart_compute_domain_objects(namespace: str) -> list[tuple[str, dict[str, Any]]]:
    """The chart's ComputeDomain objects but the controller Deployment (run here as a process), each
    with the collection to create it in: what `helm install --set driverName=gpu.nvidia.com` creates."""
    objects = []
    for obj in manifests.rendered_chart("cd", namespace, f"driverName={DRIVER}"):
        if obj["kind"] not in _PATHS:
            continue
        if obj["kind"] != "CustomResourceDefinition" and "compute-domain" not in obj["metadata"]["name"]:
            continue
        objects.append((_PATHS[obj["kind"]].format(ns=namespace), obj))
    return objects


def _kubeconfig_of(cluster: ClusterInfo, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig with a token of `account` alone: the permissions the chart gives it, no more."""
    with cluster.api_client() as api:
        token = mint_service_account_token(api, namespace, account, expiration_seconds=7200)
    write_kubeconfig(
        path, server=cluster.server, ca_certificate=cluster.ca_file.read_bytes(), user=account, token=token
    )
    return path


@pytest.fixture(scope="module")
def rack(
    cluster: ClusterInfo,
    control_plane_binaries: ControlPlaneBinaries,
    kubelet_harness_binary: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Rack]:
    rest = cluster.rest()
    base = tmp_path_factory.mktemp("cd")  # short: socket paths have a 107-byte limit
    created: list[str] = []
    stops: list[Any] = []
    driver_namespace = f"cd-driver-{uuid.uuid4().hex[:6]}"
    try:
        rest.create("/api/v1/namespaces", {"metadata": {"name": driver_namespace}})
        created.append(f"/api/v1/namespaces/{driver_namespace}")
        # The chart's CRD, DeviceClasses, accounts and RBAC, as `helm install` would create them.
        for collection, obj in _chart_compute_domain_objects(driver_namespace):
            rest.create(collection, obj)
            created.append(f"{collection}/{obj['metadata']['name']}")
        for crd_name in ("computedomains.resource.nvidia.com", "computedomaincliques.resource.nvidia.com"):
            manifests.wait_established(rest, crd_name)

        extra = ExtraControllers(control_plane_binaries, cluster, base / "kube-controller-manager.log")
        extra.start()
        stops.append(extra.stop)
        # The controller and the daemons run with the chart's RBAC only.
        controller_kubeconfig = _kubeconfig_of(
            cluster,
            driver_namespace,
            "cd-dra-driver-gpu-compute-domain-controller",
            base / "controller.kubeconfig",
        )
        daemon_kubeconfig = _kubeconfig_of(
            cluster, driver_namespace, "compute-domain-daemon", base / "daemon.kubeconfig"
        )
        # Two replicas, as with `computeDomainController.replicas: 2`: one leads, one stands by.
        controllers = [
            ControllerProcess(
                controller_kubeconfig, driver_namespace, base / f"controller-{n}.log", READY_TIMEOUT, n
            )
            for n in ("a", "b")
        ]
        for controller in controllers:
            controller.start()
            stops.append(controller.stop)
        wait(lambda: any(c.leading for c in controllers), timeout=60, what="a controller to lead")

        nodes: dict[str, GpuNode] = {}
        for name, clique in CLIQUES.items():
            node_dir = base / name.removeprefix("cd-tray-")
            if name in NVML_TRAYS:  # NVML's fabric info, from the mock's GB200 NVL72 tray
                node = GpuNode(
                    cluster,
                    kubelet_harness_binary,
                    node_dir,
                    name,
                    mock_nvml="gb200nvl72",
                    driver_args=[f"--driver-name={DRIVER}"],
                    driver_wrapper=nvml_tray_wrapper(node_dir, CLUSTER_UUID, clique),
                )
            else:
                node = GpuNode(
                    cluster,
                    kubelet_harness_binary,
                    node_dir,
                    name,
                    profile="gb200-tray",
                    driver_args=[f"--driver-name={DRIVER}", f"--simulate-fabric={CLUSTER_UUID}/{clique}"],
                )
            stops.append(node.remove)
            node.start()
            nodes[name] = node
        # A DGX H100 on the mock NVML: NVLink inside the node only (a zero cluster UUID), no clique.
        plain = GpuNode(
            cluster,
            kubelet_harness_binary,
            base / "h100",
            NO_FABRIC_NODE,
            mock_nvml="dgxh100",
            driver_args=[f"--driver-name={DRIVER}"],
        )
        stops.append(plain.remove)
        plain.start()
        nodes[NO_FABRIC_NODE] = plain
        pod_ips = {name: f"127.0.{77 + i}.1" for i, name in enumerate(CLIQUES)}
        (port,) = free_ports(1)
        runner = DaemonPodRunner(rest, daemon_kubeconfig, driver_namespace, nodes, pod_ips, port, base)
        runner.start()
        stops.append(runner.stop)
        yield Rack(rest, nodes, runner, driver_namespace, controllers)
    finally:
        for stop in reversed(stops):
            stop()
        for path in reversed(created):
            rest.delete(path)


def _channel_template(rest: RestClient, namespace: str, name: str) -> dict[str, Any]:
    """The ResourceClaimTemplate ``name`` once the controller has made it for its domain."""
    return rest.wait_for(
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates", name, lambda _: True
    )


def domain_with_template(rest: RestClient, namespace: str, name: str) -> dict[str, Any]:
    """A one-node ComputeDomain ``name`` whose channel template is ``<name>-channel``, created and its
    template waited for (the controller's first answer); returns the template."""
    domain = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
    }
    rest.create(domains_path(namespace), domain)
    return _channel_template(rest, namespace, f"{name}-channel")


def _pods(rest: RestClient, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = rest.request(
        "GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector}
    )["items"]
    return items


def _domain(rest: RestClient, namespace: str, name: str) -> dict[str, Any]:
    return rest.get(domains_path(namespace, name))


def _ready_condition(domain: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in domain.get("status", {}).get("conditions", []) if c["type"] == "Ready"), {})


def _events(rest: RestClient, namespace: str, name: str) -> list[dict[str, Any]]:
    items = rest.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
    return [
        e
        for e in items
        if e["involvedObject"].get("kind") == "ComputeDomain" and e["involvedObject"]["name"] == name
    ]


def _cliques(rack: Rack) -> list[dict[str, Any]]:
    path = f"/apis/resource.nvidia.com/v1beta1/namespaces/{rack.driver_namespace}/computedomaincliques"
    items: list[dict[str, Any]] = rack.rest.request("GET", path)["items"]
    return items


def _labelled_nodes(rest: RestClient) -> dict[str, str]:
    items = rest.request("GET", "/api/v1/nodes", query={"labelSelector": LABEL})["items"]
    return {n["metadata"]["name"]: n["metadata"]["labels"][LABEL] for n in items}


SCHEDULER_POLL_S = 5.0  # how often the scheduler looks at a claim whose binding conditions it waits for


def _workload(name: str, template: str) -> dict[str, Any]:
    """A bare pod with one channel claim from ``template``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {"name": "ctr", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "channel"}]}}
            ],
            "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
        },
    }


def _allocated_channel(rest: RestClient, namespace: str, pod: str) -> dict[str, Any]:
    """The pod's channel claim once the scheduler has allocated it (the pod may still be unbound)."""

    def allocated() -> dict[str, Any] | None:
        statuses = rest.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")["status"].get(
            "resourceClaimStatuses"
        )
        if not statuses:
            return None
        (status,) = statuses
        path = f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{status['resourceClaimName']}"
        claim: dict[str, Any] = rest.get(path)
        return claim if claim.get("status", {}).get("allocation") else None

    found: dict[str, Any] = wait(
        allocated, timeout=60, what=f"the channel claim of pod {pod} to be allocated"
    )
    return found


@contextlib.contextmanager
def _peer_port_taken_on_every_tray(rack: Rack) -> Iterator[None]:
    """The IMEX daemons' peer port held by another listener on every tray while inside: a daemon
    there cannot start its IMEX part (it fails and retries), and can once the block is left."""
    with contextlib.ExitStack() as squatters:
        for node in CLIQUES:
            squatter = squatters.enter_context(socket.socket())
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind((rack.runner.pod_ips[node], rack.runner.port))
            squatter.listen()
        yield


def _channel_conditions(claim: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The conditions of the claim's status.devices entry of the compute-domain driver, by type."""
    entries = claim.get("status", {}).get("devices") or []
    return {c["type"]: c for e in entries if e["driver"] == CD_DRIVER for c in e.get("conditions") or []}


def test_a_two_node_domain_runs_its_job_on_one_clique_and_cleans_up(rack: Rack, namespace: str) -> None:
    rest = rack.rest
    (domain,) = manifests.load(EXAMPLES / "compute-domain.yaml")
    job_manifest = manifests.load(EXAMPLES / "multi-node-job.yaml")[0]
    name = domain["metadata"]["name"]
    template_name = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
    rest.create(domains_path(namespace), domain)
    template = _channel_template(rest, namespace, template_name)
    selector = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"][
        "expression"
    ]
    rest.create(f"/apis/batch/v1/namespaces/{namespace}/jobs", job_manifest)

    # Both workers run, on two nodes of one clique, each with channel 0 of its own node.
    def running_workers() -> list[dict[str, Any]]:
        pods = [
            p for p in _pods(rest, namespace, "app=nvbandwidth-test") if p["status"].get("phase") == "Running"
        ]
        return pods if len(pods) == 2 else []

    workers = wait(running_workers, timeout=120, what="both workers running")
    hosts = sorted(p["spec"]["nodeName"] for p in workers)
    assert len(set(hosts)) == 2
    assert len({rack.clique_of(h) for h in hosts}) == 1
    # Both cliques have two free nodes; the first (by name) wins: the trays on the mock NVML, whose
    # clique came from nvmlDeviceGetGpuFabricInfo.
    assert set(hosts) == NVML_TRAYS
    assert rack.clique_of(hosts[0]) in selector
    allocations = set()
    for pod in workers:
        (status,) = pod["status"]["resourceClaimStatuses"]
        claim = rest.get(
            f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{status['resourceClaimName']}"
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        allocations.add((result["pool"], result["device"]))
        (cdi_id,) = yaml.safe_load(pod["metadata"]["annotations"][CDI_ANNOTATION])["worker"]
        assert cdi_id == f"k8s.{CD_DRIVER}/claim={claim['metadata']['uid']}-channel-0"
        spec = (
            rack.nodes[pod["spec"]["nodeName"]].driver.paths.cdi
            / f"k8s.{CD_DRIVER}-claim_{claim['metadata']['uid']}.json"
        )
        (device,) = json.loads(spec.read_text())["devices"]
        # channel 0 with the major number the node's /proc/devices gives the IMEX channels
        assert device["containerEdits"]["deviceNodes"] == [
            {
                "path": "/dev/nvidia-caps-imex-channels/channel0",
                "type": "c",
                "major": IMEX_CHANNEL_MAJOR,
                "minor": 0,
            }
        ]
    assert allocations == {(h, "channel-0") for h in hosts}  # distinct channels, one per node

    # The daemons on both nodes see each other: the domain is Ready, with both nodes in its status.
    ready = wait(
        lambda: (d := _domain(rest, namespace, name)).get("status", {}).get("status") == "Ready" and d,
        timeout=90,
        what="the domain to become Ready",
    )
    assert sorted((n["name"], n["cliqueID"], n["status"]) for n in ready["status"]["nodes"]) == [
        (h, rack.clique_of(h), "Ready") for h in hosts
    ]
    assert rack.runner.running_on() == set(hosts)
    assert _labelled_nodes(rest) == dict.fromkeys(hosts, ready["metadata"]["uid"])
    # The daemons met in their ComputeDomainClique (NVIDIA's): one object for the domain's clique,
    # <domainUID>.<cliqueID> in the driver's namespace, owned by the daemon pods.
    (clique,) = _cliques(rack)
    uid = ready["metadata"]["uid"]
    assert clique["metadata"]["name"] == f"{uid}.{rack.clique_of(hosts[0])}"
    assert clique["metadata"]["labels"]["resource.nvidia.com/computeDomain"] == uid
    assert sorted((d["nodeName"], d["status"]) for d in clique["daemons"]) == [(h, "Ready") for h in hosts]
    daemon_pods = {p["metadata"]["uid"] for p in _pods(rest, rack.driver_namespace, LABEL)}
    assert {o["uid"] for o in clique["metadata"]["ownerReferences"]} == daemon_pods
    # The daemons address each other by DNS name (NVIDIA's IMEXDaemonsWithDNSNames, on by default):
    # a fixed nodes file, and each pod's /etc/hosts mapping the names to the clique's addresses.
    index = {d["nodeName"]: d["index"] for d in clique["daemons"]}
    assert sorted(index.values()) == [0, 1]
    for host in hosts:
        nodes_file = (rack.runner.config_dir(host) / "nodes_config.cfg").read_text().split()
        assert nodes_file == [f"compute-domain-daemon-{i:04d}" for i in range(18)]
        etc_hosts = rack.runner.hosts_file(host).read_text()
        assert "127.0.0.1\tlocalhost\n" in etc_hosts  # the kubelet's lines stay
        for peer in hosts:
            assert f"{rack.runner.pod_ips[peer]}\tcompute-domain-daemon-{index[peer]:04d}\n" in etc_hosts

    # A third worker finds no node: the clique's two channels are taken and the other clique is not
    # the domain's. It waits, unscheduled.
    rest.request(
        "PATCH",
        f"/apis/batch/v1/namespaces/{namespace}/jobs/nvbandwidth-test",
        {"spec": {"parallelism": 3, "completions": 3}},
        content_type="application/merge-patch+json",
    )

    def third_pending() -> dict[str, Any] | None:
        for pod in _pods(rest, namespace, "app=nvbandwidth-test"):
            conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
            if conditions.get("PodScheduled", {}).get("status") == "False":
                return pod
        return None

    pending = wait(third_pending, timeout=60, what="the third worker to be found unschedulable")
    assert not pending["spec"].get("nodeName")

    # A daemon crashes: its peer loses it and the domain turns NotReady, until it is back.
    rack.runner.kill(hosts[0])
    wait(
        lambda: _domain(rest, namespace, name)["status"]["status"] == "NotReady",
        timeout=30,
        what="the domain to notice the lost daemon",
    )
    wait(
        lambda: _domain(rest, namespace, name)["status"]["status"] == "Ready",
        timeout=60,
        what="the domain to recover",
    )
    assert rack.runner.restarts(hosts[0]) >= 1

    # Deleting the domain waits for its workloads, then removes everything it created.
    rest.delete(domains_path(namespace, name))
    deleting = wait(
        lambda: (
            _ready_condition(_domain(rest, namespace, name)).get("reason") == "Deleting"
            and _domain(rest, namespace, name)
        ),
        timeout=30,
        what="the domain to wait for its workloads",
    )
    assert "waiting for the workloads on node(s)" in _ready_condition(deleting)["message"]
    rest.request(
        "DELETE",
        f"/apis/batch/v1/namespaces/{namespace}/jobs/nvbandwidth-test",
        {"propagationPolicy": "Background"},
    )

    def gone() -> bool:
        listed = rest.request("GET", domains_path(namespace))["items"]
        return not listed

    wait(gone, timeout=120, what="the domain to be deleted")
    assert not rest.request("GET", f"/apis/apps/v1/namespaces/{rack.driver_namespace}/daemonsets")["items"]
    templates = rest.request("GET", "/apis/resource.k8s.io/v1/resourceclaimtemplates")["items"]
    assert not [t for t in templates if LABEL in (t["metadata"].get("labels") or {})]
    assert _labelled_nodes(rest) == {}
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the IMEX daemons to stop")
    # A daemon still stopping may write its entry once more after the controller removed the clique;
    # that clique is owned by the daemon's pod, now gone, so the garbage collector removes it.
    wait(lambda: not _cliques(rack), timeout=60, what="the domain's cliques to be removed")
    for node in rack.nodes.values():
        wait(
            lambda node=node: not list(node.driver.paths.cdi.glob(f"k8s.{CD_DRIVER}-claim_*.json")),
            timeout=60,
            what=f"{node.name} to unprepare every ComputeDomain claim",
        )


def _channel_domain(name: str, mode: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {
            "numNodes": 2,
            "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}, "allocationMode": mode},
        },
    }


def _workers(name: str) -> dict[str, Any]:
    """A two-worker Job in domain `name`, as multi-node-job.yaml is in its domain."""
    (job,) = manifests.load(EXAMPLES / "multi-node-job.yaml")
    job["metadata"]["name"] = name
    template = job["spec"]["template"]
    template["metadata"]["labels"] = {"app": name}
    (claim,) = template["spec"]["resourceClaims"]
    claim["resourceClaimTemplateName"] = f"{name}-channel"
    return dict(job)


def test_two_domains_created_together_get_a_clique_each_and_both_run(rack: Rack, namespace: str) -> None:
    """NVIDIA's two channel modes, Single and All, in one apply: before any workload has labelled a
    node, the second domain must still see the first one's clique as taken."""
    rest = rack.rest
    names = ("cd-single", "cd-all")
    for name, mode in (("cd-single", "Single"), ("cd-all", "All")):  # one apply: back to back
        rest.create(domains_path(namespace), _channel_domain(name, mode))
    pinned = {}
    for name in names:
        template = _channel_template(rest, namespace, f"{name}-channel")
        pinned[name] = template["metadata"]["annotations"]["resource.nvidia.com/clique"]
    assert sorted(pinned.values()) == sorted({rack.clique_of(n) for n in CLIQUES})

    for name in names:
        rest.create(f"/apis/batch/v1/namespaces/{namespace}/jobs", _workers(name))

    def all_running() -> dict[str, set[str]]:
        hosts = {
            name: {
                p["spec"]["nodeName"]
                for p in _pods(rest, namespace, f"app={name}")
                if p["status"].get("phase") == "Running"
            }
            for name in names
        }
        return hosts if all(len(h) == 2 for h in hosts.values()) else {}

    hosts = wait(all_running, timeout=180, what="both workers of both domains running")
    for name in names:
        assert {rack.clique_of(h) for h in hosts[name]} == {pinned[name]}
    for name in names:
        wait(
            lambda name=name: _domain(rest, namespace, name).get("status", {}).get("status") == "Ready",
            timeout=90,
            what=f"{name} to become Ready",
        )

    for name in names:
        rest.request(
            "DELETE",
            f"/apis/batch/v1/namespaces/{namespace}/jobs/{name}",
            {"propagationPolicy": "Background"},
        )
        rest.delete(domains_path(namespace, name))
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=180, what="deletion")
    wait(lambda: not _labelled_nodes(rest), timeout=60, what="the node labels to go")
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the IMEX daemons to stop")


def test_a_node_without_fabric_info_serves_its_gpus_but_no_compute_domains(rack: Rack) -> None:
    node = rack.nodes[NO_FABRIC_NODE]
    slices = rack.rest.request(
        "GET",
        "/apis/resource.k8s.io/v1/resourceslices",
        query={"fieldSelector": f"spec.nodeName={node.name}"},
    )["items"]
    assert {s["spec"]["driver"] for s in slices} == {DRIVER}  # its GPUs, and nothing of CD_DRIVER
    log = node.driver.daemon.log_since(0)
    assert "no ComputeDomains on this node" in log
    assert "GPUs without NVLink fabric info: GPU-" in log
    # Every clique the controller knows of is a tray's; the H100 is in none.
    cd_slices = rack.rest.request(
        "GET", "/apis/resource.k8s.io/v1/resourceslices", query={"fieldSelector": f"spec.driver={CD_DRIVER}"}
    )["items"]
    assert sorted(s["spec"]["nodeName"] for s in cd_slices) == sorted(CLIQUES)


def test_a_domain_larger_than_every_clique_says_so_and_creates_nothing(rack: Rack, namespace: str) -> None:
    rest = rack.rest
    domain = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "too-large"},
        "spec": {"numNodes": 3, "channel": {"resourceClaimTemplate": {"name": "too-large-channel"}}},
    }
    rest.create(domains_path(namespace), domain)
    stored = wait(
        lambda: _ready_condition(d := _domain(rest, namespace, "too-large")).get("reason") and d,
        timeout=30,
        what="a condition on the domain",
    )
    condition = _ready_condition(stored)
    assert (condition["status"], condition["reason"]) == ("False", "DomainLargerThanClique")
    assert "numNodes 3 is larger than every NVLink clique: the largest has 2 node(s)" in condition["message"]
    assert stored["status"]["status"] == "NotReady"
    events = wait(lambda: _events(rest, namespace, "too-large"), timeout=30, what="an event")
    assert events[0]["reason"] == "DomainLargerThanClique"
    assert events[0]["type"] == "Warning"
    templates = rest.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates")
    assert not templates["items"]
    assert not rest.request("GET", f"/apis/apps/v1/namespaces/{rack.driver_namespace}/daemonsets")["items"]
    assert not _cliques(rack)
    assert _labelled_nodes(rest) == {}
    # The spec cannot be fixed in place (as with NVIDIA's CRD): a new domain is the way.
    with pytest.raises(ApiError) as refused:
        rest.request(
            "PATCH",
            domains_path(namespace, "too-large"),
            {"spec": {"numNodes": 2}},
            content_type="application/merge-patch+json",
        )
    assert refused.value.status == 422
    assert "A computeDomain.spec is immutable" in refused.value.message
    rest.delete(domains_path(namespace, "too-large"))
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=30, what="deletion")


def test_a_channel_outside_a_domain_is_refused_with_what_to_do(
    rack: Rack, namespace: str, api: client.ApiClient
) -> None:
    rest = rack.rest
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "loose-channel"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "channel",
                        "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"},
                    }
                ]
            }
        },
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "loose"},
        "spec": {
            "containers": [
                {"name": "ctr", "image": "ubuntu:24.04", "resources": {"claims": [{"name": "channel"}]}}
            ],
            "resourceClaims": [{"name": "channel", "resourceClaimName": "loose-channel"}],
        },
    }
    manifests.apply(rest, [claim, pod], namespace)

    def refusal() -> list[dict[str, Any]]:
        """The node's refusal: with binding conditions (1.36+) the scheduler's event of the failed
        binding, whose pod goes back to it; without, the kubelet's failed prepare of the bound pod."""
        items = rest.request("GET", f"/api/v1/namespaces/{namespace}/events")["items"]
        return [e for e in items if "outside a ComputeDomain" in (e.get("message") or "")]

    (event, *_) = wait(refusal, timeout=60, what="the node's refusal in an event of the pod")
    assert event["reason"] in ("FailedPrepareDynamicResources", "FailedScheduling"), event
    assert "spec.channel.resourceClaimTemplate.name" in event["message"]
    # Refused before anything was done: no node serves a domain, no channel spec was written.
    assert _labelled_nodes(rest) == {}
    claim_uid = rest.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/loose-channel")[
        "metadata"
    ]["uid"]
    for node in rack.nodes.values():
        assert not list(node.driver.paths.cdi.glob(f"k8s.{CD_DRIVER}-claim_{claim_uid}.json"))
    client.CoreV1Api(api).delete_namespaced_pod("loose", namespace, grace_period_seconds=0)


def test_a_failing_imex_daemon_keeps_the_domain_not_ready_and_says_why(
    rack: Rack, namespace: str, api: client.ApiClient
) -> None:
    """NVIDIA #289: a domain must not turn Ready while its IMEX daemon fails. Here the daemon's peer
    port is taken on every tray, so its IMEX part cannot start; once the port is free it recovers."""
    rest = rack.rest
    with _peer_port_taken_on_every_tray(rack):
        domain_with_template(rest, namespace, "failing")
        manifests.apply(rest, [_workload("waiting", "failing-channel")], namespace)
        (result,) = _allocated_channel(rest, namespace, "waiting")["status"]["allocation"]["devices"][
            "results"
        ]
        node = result["pool"]  # where the scheduler placed the channel; the pod waits in binding
        failed = wait(
            lambda: (
                _ready_condition(d := _domain(rest, namespace, "failing")).get("reason") == "DaemonFailed"
                and d
            ),
            timeout=90,
            what="the DaemonFailed condition",
        )
        address = f"{rack.runner.pod_ips[node]}:{rack.runner.port}"
        assert _ready_condition(failed)["message"] == (
            f"the IMEX daemon on node {node} failed: IMEX daemon cannot listen on {address}: "
            "Address already in use; retrying"
        )
        assert failed["status"]["status"] == "NotReady"
        assert [(n["name"], n["status"]) for n in failed["status"]["nodes"]] == [(node, "NotReady")]
        (event,) = [e for e in _events(rest, namespace, "failing") if e["reason"] == "DaemonFailed"]
        assert event["type"] == "Warning"
        # It stays so past the readiness timeout, and the workload waits, unbound: its channel's
        # binding condition holds it until its node's daemon is ready (and would send it back to the
        # scheduler after a minute of failure, longer than this test waits).
        time.sleep(READY_TIMEOUT + 3)
        still = _domain(rest, namespace, "failing")
        assert still["status"]["status"] == "NotReady"
        assert _ready_condition(still)["reason"] == "DaemonFailed"
        waiting = rest.get(f"/api/v1/namespaces/{namespace}/pods/waiting")
        assert waiting["status"].get("phase") == "Pending"
        assert not waiting["spec"].get("nodeName")

    # The port is free again: the daemon's next try starts, the domain turns Ready, the pod runs.
    wait(
        lambda: _domain(rest, namespace, "failing")["status"]["status"] == "Ready",
        timeout=60,
        what="the domain to recover",
    )
    assert _ready_condition(_domain(rest, namespace, "failing"))["reason"] == "DaemonsReady"
    wait(
        lambda: rest.get(f"/api/v1/namespaces/{namespace}/pods/waiting")["status"].get("phase") == "Running",
        timeout=60,
        what="the workload to run",
    )
    assert rest.get(f"/api/v1/namespaces/{namespace}/pods/waiting")["spec"]["nodeName"] == node
    assert rack.runner.restarts(node) == 0  # the daemon process never exited: it retried

    rest.delete(domains_path(namespace, "failing"))
    client.CoreV1Api(api).delete_namespaced_pod("waiting", namespace, grace_period_seconds=0)
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=90, what="deletion")
    wait(lambda: not _labelled_nodes(rest), timeout=60, what="the node label to go")
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the daemon to stop")
    assert not rest.request("GET", f"/apis/apps/v1/namespaces/{rack.driver_namespace}/daemonsets")["items"]
    wait(lambda: not _cliques(rack), timeout=30, what="the domain's clique to go")


def test_a_workload_waits_in_binding_until_its_imex_daemon_is_ready_then_runs(
    rack: Rack, namespace: str, api: client.ApiClient
) -> None:
    """Binding conditions (Kubernetes 1.36+): the scheduler allocates the channel and waits; the node
    labels itself at once, so the domain's IMEX daemon pod starts there, and reports the channel
    Ready once that daemon is; only then is the pod bound, and the kubelet's prepare finds it done.
    Here the daemon's container is held back (as an image still being pulled) on every tray."""
    rest = rack.rest
    rack.runner.hold(set(CLIQUES))
    try:
        uid = domain_with_template(rest, namespace, "held")["metadata"]["labels"][LABEL]
        manifests.apply(rest, [_workload("held", "held-channel")], namespace)
        claim = _allocated_channel(rest, namespace, "held")
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["device"]) == (CD_DRIVER, "channel-0")
        assert result["bindingConditions"] == ["Ready"]
        assert result["bindingFailureConditions"] == ["PrepareFailed"]
        node = result["pool"]
        since = rack.nodes[node].driver.daemon.log_size()

        # Ahead of the binding, the node joined the domain: its daemon pod runs there, the daemon not yet.
        wait(lambda: _labelled_nodes(rest) == {node: uid}, timeout=30, what="the node to label itself")
        wait(
            lambda: [
                p
                for p in _pods(rest, rack.driver_namespace, LABEL)
                if p["spec"].get("nodeName") == node and p["status"].get("phase") == "Running"
            ],
            timeout=60,
            what="the IMEX daemon pod to run on the channel's node",
        )
        # Longer than two of the scheduler's polls: the pod stays unbound while its daemon is not ready.
        time.sleep(2 * SCHEDULER_POLL_S + 1)
        waiting = rest.get(f"/api/v1/namespaces/{namespace}/pods/held")
        assert not waiting["spec"].get("nodeName"), "bound before its IMEX daemon was ready"
        assert "Ready" not in _channel_conditions(
            rest.get(
                f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{claim['metadata']['name']}"
            )
        )
        events = rest.request(
            "GET",
            f"/api/v1/namespaces/{namespace}/events",
            query={"fieldSelector": "involvedObject.name=held"},
        )["items"]
        assert "BindingConditionsPending" in {e["reason"] for e in events}
        assert node not in rack.runner.running_on()
        assert _domain(rest, namespace, "held").get("status", {}).get("status") != "Ready"
    finally:
        rack.runner.release()

    # The daemon starts and turns Ready; the node reports the channel Ready; the scheduler binds.
    running = wait(
        lambda: (
            (p := rest.get(f"/api/v1/namespaces/{namespace}/pods/held"))["status"].get("phase") == "Running"
            and p
        ),
        timeout=60,
        what="the workload to run",
    )
    assert running["spec"]["nodeName"] == node
    claim = rest.get(
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{claim['metadata']['name']}"
    )
    ready = _channel_conditions(claim)["Ready"]
    assert (ready["status"], ready["reason"]) == ("True", "Prepared")
    (cdi_id,) = yaml.safe_load(running["metadata"]["annotations"][CDI_ANNOTATION])["ctr"]
    assert cdi_id == f"k8s.{CD_DRIVER}/claim={claim['metadata']['uid']}-channel-0"
    log = rack.nodes[node].driver.daemon.log_since(since)
    assert "channel prepared ahead of binding: the node's IMEX daemon is ready" in log
    assert "channel prepared ahead of binding; the kubelet takes it over" in log

    rest.delete(domains_path(namespace, "held"))
    client.CoreV1Api(api).delete_namespaced_pod("held", namespace, grace_period_seconds=0)
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=90, what="deletion")
    wait(lambda: not _labelled_nodes(rest), timeout=60, what="the node label to go")
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the daemon to stop")
    wait(lambda: not _cliques(rack), timeout=30, what="the domain's clique to go")


def test_a_workload_whose_imex_daemon_keeps_failing_goes_back_to_the_scheduler_with_the_reason(
    rack: Rack, namespace: str, api: client.ApiClient
) -> None:
    """Binding conditions: after a minute of its daemon failing, the node fails the channel's binding
    and leaves the domain; the scheduler takes the allocation back and tries again, the pod never
    bound meanwhile. Once the daemon can start, the pod runs."""
    rest = rack.rest
    with _peer_port_taken_on_every_tray(rack):  # the daemons' IMEX part cannot start
        domain_with_template(rest, namespace, "doomed")
        manifests.apply(rest, [_workload("doomed", "doomed-channel")], namespace)

        def failure_reported() -> str | None:
            """The scheduler's event naming the node's reason, once the binding failed."""
            items = rest.request(
                "GET",
                f"/api/v1/namespaces/{namespace}/events",
                query={"fieldSelector": "involvedObject.name=doomed"},
            )["items"]
            return next(
                (str(e["message"]) for e in items if "failed for 60s" in (e.get("message") or "")), None
            )

        message = wait(failure_reported, timeout=150, what="the binding failure's event")
        assert "device binding failed" in message  # the scheduler's words, then the node's
        assert "reason=PrepareFailed" in message
        assert f"the IMEX daemon of ComputeDomain {namespace}/doomed on node " in message
        assert "IMEX daemon cannot listen on" in message  # the daemon's own reason
        assert not rest.get(f"/api/v1/namespaces/{namespace}/pods/doomed")["spec"].get("nodeName")

    running = wait(
        lambda: (
            (p := rest.get(f"/api/v1/namespaces/{namespace}/pods/doomed"))["status"].get("phase") == "Running"
            and p
        ),
        timeout=120,
        what="the workload to run once its daemon can start",
    )
    claim = _allocated_channel(rest, namespace, "doomed")
    assert _channel_conditions(claim)["Ready"]["status"] == "True"
    assert "PrepareFailed" not in _channel_conditions(claim)  # the allocation was taken back and made anew
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["pool"] == running["spec"]["nodeName"]
    assert _labelled_nodes(rest) == {result["pool"]: _domain(rest, namespace, "doomed")["metadata"]["uid"]}

    rest.delete(domains_path(namespace, "doomed"))
    client.CoreV1Api(api).delete_namespaced_pod("doomed", namespace, grace_period_seconds=0)
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=90, what="deletion")
    wait(lambda: not _labelled_nodes(rest), timeout=60, what="the node label to go")
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the daemon to stop")
    wait(lambda: not _cliques(rack), timeout=30, what="the domain's clique to go")


def test_of_two_controllers_one_leads_and_a_killed_leader_hands_over(rack: Rack, namespace: str) -> None:
    """Two replicas: only the Lease holder reconciles; SIGKILLed (no release), the other takes over."""
    rest = rack.rest
    lease_path = (
        f"/apis/coordination.k8s.io/v1/namespaces/{rack.driver_namespace}/leases/{ControllerProcess.LEASE}"
    )
    (leader,) = [c for c in rack.controllers if c.leading]
    (standby,) = [c for c in rack.controllers if c is not leader]
    before = rest.get(lease_path)["spec"]
    # The earlier tests' domains were set up and judged by the leader alone.
    assert "ComputeDomain set up" in leader.log()
    assert "ComputeDomain" not in standby.log()
    assert "became the leader" not in standby.log()

    leader.kill()
    wait(
        lambda: standby.leading,
        timeout=ControllerProcess.LEASE_SECONDS * 4 + 30,
        what="the standby to take the Lease over",
    )
    after = rest.get(lease_path)["spec"]
    assert after["holderIdentity"] != before["holderIdentity"]
    assert after["leaseTransitions"] == before["leaseTransitions"] + 1

    # The new leader acts on a new domain.
    domain_with_template(rest, namespace, "after-handover")
    wait(lambda: "ComputeDomain set up" in standby.log(), timeout=30, what="the new leader's log line")

    # The old leader comes back as the standby: the Lease is held, so it waits.
    leader.start()
    wait(
        lambda: rest.get(lease_path)["spec"]["renewTime"] != after["renewTime"],
        timeout=30,
        what="the new leader to renew",
    )
    assert not leader.leading
    rest.delete(domains_path(namespace, "after-handover"))
    wait(lambda: not rest.request("GET", domains_path(namespace))["items"], timeout=60, what="deletion")
    assert "ComputeDomain" not in leader.log()

    # An orderly stop (SIGTERM, as at a rolling update) releases the Lease instead of letting it
    # expire; the standby takes it.
    standby.stop()
    assert "released the leader lease" in standby.log()
    wait(lambda: leader.leading, timeout=30, what="the other replica to take the released Lease")
    standby.start()  # the rack keeps its two replicas


# NVIDIA's own ComputeDomain manifests, unchanged: demo/specs/imex/channel-injection.yaml and
# channel-injection-all.yaml of kubernetes-sigs/dra-driver-nvidia-gpu ...
NVIDIA_CHANNEL_INJECTION = """
---
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata:
  name: imex-channel-injection
spec:
  numNodes: 1
  channel:
    resourceClaimTemplate:
      name: imex-channel-0
---
apiVersion: v1
kind: Pod
metadata:
  name: imex-channel-injection
spec:
  containers:
  - name: ctr
    image: ubuntu:22.04
    command: ["bash", "-c"]
    args: ["ls -la /dev/nvidia-caps-imex-channels; trap 'exit 0' TERM; sleep 9999 & wait"]
    resources:
      claims:
      - name: imex-channel-0
  resourceClaims:
  - name: imex-channel-0
    resourceClaimTemplateName: imex-channel-0
"""
NVIDIA_CHANNEL_INJECTION_ALL = """
---
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata:
  name: imex-channel-injection-all
spec:
  numNodes: 1
  channel:
    allocationMode: All
    resourceClaimTemplate:
      name: tpl-imex-channels
---
apiVersion: v1
kind: Pod
metadata:
  name: imex-channel-injection-all
spec:
  containers:
  - name: ctr
    image: ubuntu:22.04
    command: ["bash", "-c"]
    args: ["ls -la /dev/nvidia-caps-imex-channels; trap 'exit 0' TERM; sleep 9999 & wait"]
    resources:
      claims:
      - name: imex-channels
  resourceClaims:
  - name: imex-channels
    resourceClaimTemplateName: tpl-imex-channels
"""
# ... and the ComputeDomain and workload of its guide (site/content/docs/guides/
# compute-domain-workloads.md): numNodes 0, as recommended with IMEXDaemonsWithDNSNames. Its template
# name is the demo's, so it goes into a namespace of its own.
NVIDIA_GUIDE = """
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata:
  name: my-compute-domain
spec:
  numNodes: 0
  channel:
    resourceClaimTemplate:
      name: imex-channel-0
---
apiVersion: v1
kind: Pod
metadata:
  name: my-workload
spec:
  containers:
  - name: app
    image: my-image
    command: ["bash", "-c"]
    args: ["ls -la /dev/nvidia-caps-imex-channels; sleep 9999"]
    resources:
      claims:
      - name: imex-channel-0
  resourceClaims:
  - name: imex-channel-0
    resourceClaimTemplateName: imex-channel-0
"""


def _apply(rest: RestClient, text: str, namespace: str) -> list[dict[str, Any]]:
    """Creates every object of `text` in `namespace`, as `kubectl apply -f` does: one after the other."""
    objects = [o for o in yaml.safe_load_all(text) if o]
    for obj in objects:
        if obj["kind"] == "ComputeDomain":
            rest.create(domains_path(namespace), obj)
        else:
            rest.create(manifests.collection(obj["kind"], namespace), obj)
    return objects


def _channel_nodes(rack: Rack, namespace: str, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The device nodes the CDI spec of the pod's one channel claim gives its container."""
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = rack.rest.get(
        f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{status['resourceClaimName']}"
    )
    spec = (
        rack.nodes[pod["spec"]["nodeName"]].driver.paths.cdi
        / f"k8s.{CD_DRIVER}-claim_{claim['metadata']['uid']}.json"
    )
    (device,) = json.loads(spec.read_text())["devices"]
    nodes: list[dict[str, Any]] = device["containerEdits"]["deviceNodes"]
    return nodes


def test_nvidias_own_compute_domain_examples_run_unchanged_applied_together(
    rack: Rack, namespace: str, api: client.ApiClient
) -> None:
    """NVIDIA's demo specs for both channel modes and its guide's domain, created in one go before any
    workload has landed: each domain gets a node of its own, every pod runs with its channels."""
    rest = rack.rest
    guide_namespace = f"{namespace}-guide"
    rest.create("/api/v1/namespaces", {"metadata": {"name": guide_namespace}})
    try:
        started = time.monotonic()
        _apply(rest, NVIDIA_CHANNEL_INJECTION + NVIDIA_CHANNEL_INJECTION_ALL, namespace)
        _apply(rest, NVIDIA_GUIDE, guide_namespace)
        applied_in = time.monotonic() - started
        assert applied_in < 2.0  # one apply: the controller sees all three before any workload lands
        pods = {
            (namespace, "imex-channel-injection"): "imex-channel-injection",
            (namespace, "imex-channel-injection-all"): "imex-channel-injection-all",
            (guide_namespace, "my-workload"): "my-compute-domain",
        }

        def all_running() -> dict[tuple[str, str], dict[str, Any]]:
            found = {key: rest.get(f"/api/v1/namespaces/{key[0]}/pods/{key[1]}") for key in pods}
            return found if all(p["status"].get("phase") == "Running" for p in found.values()) else {}

        running = wait(all_running, timeout=180, what="the three example pods running")
        hosts = {key: pod["spec"]["nodeName"] for key, pod in running.items()}
        assert len(set(hosts.values())) == 3  # a node each: one node serves one domain
        assert set(hosts.values()) <= set(CLIQUES)

        # Single: channel 0; All: every channel of the node (the driver's default count, 2048).
        single = _channel_nodes(rack, namespace, running[(namespace, "imex-channel-injection")])
        assert [n["path"] for n in single] == ["/dev/nvidia-caps-imex-channels/channel0"]
        every = _channel_nodes(rack, namespace, running[(namespace, "imex-channel-injection-all")])
        assert [n["minor"] for n in every] == list(range(2048))
        assert every[2047]["path"] == "/dev/nvidia-caps-imex-channels/channel2047"
        all_host = running[(namespace, "imex-channel-injection-all")]["spec"]["nodeName"]
        # The major number of the node's /proc/devices on a mock-NVML tray; the simulator's own.
        major = IMEX_CHANNEL_MAJOR if all_host in NVML_TRAYS else SIMULATED_CHANNEL_MAJOR
        assert {n["major"] for n in every} == {major}
        guide = _channel_nodes(rack, guide_namespace, running[(guide_namespace, "my-workload")])
        assert [n["path"] for n in guide] == ["/dev/nvidia-caps-imex-channels/channel0"]

        # Every domain is Ready with its one node; numNodes 0 counts the nodes that joined.
        for (ns, pod_name), domain_name in pods.items():
            ready = wait(
                lambda ns=ns, domain_name=domain_name: (
                    (d := _domain(rest, ns, domain_name)).get("status", {}).get("status") == "Ready" and d
                ),
                timeout=90,
                what=f"{domain_name} to become Ready",
            )
            host = hosts[(ns, pod_name)]
            assert [(n["name"], n["cliqueID"], n["status"]) for n in ready["status"]["nodes"]] == [
                (host, rack.clique_of(host), "Ready")
            ]
    finally:
        for ns, pod_name in (
            (namespace, "imex-channel-injection"),
            (namespace, "imex-channel-injection-all"),
            (guide_namespace, "my-workload"),
        ):
            with contextlib.suppress(client.ApiException):
                client.CoreV1Api(api).delete_namespaced_pod(pod_name, ns, grace_period_seconds=0)
        for ns in (namespace, guide_namespace):
            for item in rest.request("GET", domains_path(ns))["items"]:
                rest.delete(domains_path(ns, item["metadata"]["name"]))
    both = (namespace, guide_namespace)
    wait(
        lambda: not any(rest.request("GET", domains_path(ns))["items"] for ns in both),
        timeout=180,
        what="the domains to be deleted",
    )
    wait(lambda: not _labelled_nodes(rest), timeout=60, what="the node labels to go")
    wait(lambda: not rack.runner.running_on(), timeout=60, what="the IMEX daemons to stop")
    rest.delete(f"/api/v1/namespaces/{guide_namespace}")
