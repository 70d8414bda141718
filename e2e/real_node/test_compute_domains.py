"""A ComputeDomain on the real node, with the chart as a user installs it: NVIDIA's channel-injection
example, and the pod's container sees its IMEX channel device node, created by runc from the CDI
spec the compute-domain driver wrote once the domain's IMEX daemon -- a pod of its own, in
containerd -- reported Ready.

The chart is installed as NVIDIA's stand-in (driverName gpu.nvidia.com) on a simulated GB200 NVL72
tray, so the example applies as NVIDIA's users write it (with this suite's image: nothing is
pulled). Everything that runs is a pod on the kubelet: the plugin (the chart's DaemonSet), the
compute-domain controller (the chart's Deployment, its ReplicaSet made by the upstream Deployment
controller), the IMEX daemon (the controller's DaemonSet, `dra-driver compute-domain-daemon`) and
the workload.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from e2e import manifests
from e2e.cluster import ClusterInfo, RestClient
from e2e.daemon import wait_until
from e2e.real_node.driver import CHART, NAMESPACE, RELEASE, DriverRelease
from e2e.realnode import config
from e2e.realnode.images import IMAGES, chart_app_version
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

DRIVER = "gpu.nvidia.com"
GROUP = "resource.nvidia.com"
LABEL = f"{GROUP}/computeDomain"
FABRIC = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b/1"
CONTROLLER = f"{RELEASE}-compute-domain-controller"  # the Deployment, its account and its Lease
CONTROLLER_SELECTOR = (
    f"app.kubernetes.io/name={RELEASE}-compute-domain-controller,app.kubernetes.io/instance={RELEASE}"
)
SIMULATED_CHANNEL_MAJOR = 234  # the simulator's nvidia-caps-imex-channels major
EXAMPLE = manifests.EXAMPLES / "compute-domain" / "channel-injection.yaml"
DOMAINS = f"/apis/{GROUP}/v1beta1/computedomains"
MERGE_PATCH = "application/merge-patch+json"

_T = TypeVar("_T")


def _wait(probe: Callable[[], _T | None], what: str, timeout: float = 180) -> _T:
    return wait_until(probe, timeout_seconds=timeout, waiting_for=what)


def _delete_domains(rest: RestClient) -> None:
    """Domains go before their controller: one left with its finalizer would hold the CRD's deletion
    at `helm uninstall`. Should the controller not clean up (the failure a test shows), the finalizers
    are dropped so that the release still goes, and the error is raised afterwards."""

    def paths() -> list[str]:
        items = rest.get(DOMAINS)["items"]
        return [
            f"/apis/{GROUP}/v1beta1/namespaces/{i['metadata']['namespace']}/computedomains/{i['metadata']['name']}"
            for i in items
        ]

    for path in paths():
        rest.delete(path)
    try:
        _wait(lambda: not paths(), "the ComputeDomains to be cleaned up", 60)
    except TimeoutError:
        for path in paths():
            rest.request("PATCH", path, {"metadata": {"finalizers": None}}, content_type=MERGE_PATCH)
        raise


@pytest.fixture(scope="module")
def tray(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart as gpu.nvidia.com on one GB200 tray in an NVLink clique, with its defaults
    otherwise: computeDomainController.enabled is true, so the controller's Deployment is installed."""
    release = DriverRelease(real_cluster, real_node, helm, chart_app_version())
    release.helm_run(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *release.values(),
        "--set", f"driverName={DRIVER}",
        "--set", "simulate=gb200-tray",
        "--set", f"simulateFabric={FABRIC}",
        "--set", "migPartitions=all",
    )  # fmt: skip
    try:
        release.wait_ready()
        yield release
    finally:
        try:
            _delete_domains(real_cluster.rest())
        finally:
            release.uninstall()


@pytest.fixture(scope="module")
def controller_pod(tray: DriverRelease) -> client.V1Pod:
    """The controller's pod once it leads: what the chart's Deployment made, running on the node."""
    with tray.cluster.api_client() as api:
        core = client.CoreV1Api(api)

        def leading() -> client.V1Pod | None:
            pods = core.list_namespaced_pod(NAMESPACE, label_selector=CONTROLLER_SELECTOR).items
            running = [p for p in pods if p.status.phase == "Running" and not p.metadata.deletion_timestamp]
            if len(running) != 1:
                return None
            log = core.read_namespaced_pod_log(running[0].metadata.name, NAMESPACE)
            return running[0] if "compute-domain controller running" in log else None

        try:
            return _wait(leading, "the compute-domain controller's pod to run and lead", 120)
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{tray.node.failure_summary()}") from None


def _example(image: str) -> list[dict[str, Any]]:
    objects = manifests.load(EXAMPLE)
    for obj in objects:
        for container in obj.get("spec", {}).get("containers", []):
            container["image"] = image
    return objects


def _log_messages(core: client.CoreV1Api, pod: str) -> list[dict[str, Any]]:
    """The pod's JSON log lines (the chart's logFormat=json here), as kubectl logs shows them."""
    text = core.read_namespaced_pod_log(pod, NAMESPACE)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_compute_domain_controller_runs_as_the_charts_deployment(
    tray: DriverRelease, controller_pod: client.V1Pod, real_api: client.ApiClient
) -> None:
    apps = client.AppsV1Api(real_api)
    deployment = apps.read_namespaced_deployment(CONTROLLER, NAMESPACE)
    assert deployment.metadata.annotations["meta.helm.sh/release-name"] == RELEASE
    assert deployment.metadata.labels["app.kubernetes.io/managed-by"] == "Helm"
    assert (deployment.status.ready_replicas, deployment.status.available_replicas) == (1, 1)
    # Pod <- ReplicaSet <- Deployment: the upstream controllers made it from the chart's template.
    (owner,) = controller_pod.metadata.owner_references
    assert owner.kind == "ReplicaSet"
    replica_set = apps.read_namespaced_replica_set(owner.name, NAMESPACE)
    assert [(o.kind, o.name) for o in replica_set.metadata.owner_references] == [("Deployment", CONTROLLER)]
    assert controller_pod.spec.node_name == config.NODE_NAME
    assert controller_pod.spec.service_account_name == CONTROLLER
    (container,) = controller_pod.spec.containers
    assert container.image == f"{IMAGES['driver']}:{tray.tag}"
    assert container.command == ["dra-driver", "compute-domain-controller"]
    # It holds the chart's Lease under its own pod name (POD_NAME from the downward API).
    lease = client.CoordinationV1Api(real_api).read_namespaced_lease(CONTROLLER, NAMESPACE)
    assert lease.spec.holder_identity.startswith(f"{controller_pod.metadata.name}_")


def test_a_compute_domain_channel_claim_gives_the_pod_its_imex_channel_device(
    tray: DriverRelease, controller_pod: client.V1Pod, real_api: client.ApiClient, namespace: str
) -> None:
    rest = tray.cluster.rest()
    domain, pod = _example(f"{IMAGES['workload']}:{tray.tag}")
    domains = f"/apis/{GROUP}/v1beta1/namespaces/{namespace}/computedomains"
    rest.create(domains, domain)
    _wait(
        lambda: rest.get(f"/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates")["items"],
        "the channel's ResourceClaimTemplate",
        timeout=60,
    )
    client.CoreV1Api(real_api).create_namespaced_pod(namespace, pod)
    core = client.CoreV1Api(real_api)

    def running() -> bool:
        return core.read_namespaced_pod(pod["metadata"]["name"], namespace).status.phase == "Running"

    _wait(running, "the pod to run (after its node's IMEX daemon pod reported Ready)")
    log = _wait(
        lambda: core.read_namespaced_pod_log(pod["metadata"]["name"], namespace) or None, "the pod's log", 60
    )
    # busybox ls -la: "crw-rw-rw- 1 root root 234, 0 <date> channel0"
    (entry,) = [line for line in log.splitlines() if line.endswith(" channel0")]
    assert re.match(rf"^c\S+\s+\d+\s+\S+\s+\S+\s+{SIMULATED_CHANNEL_MAJOR},\s+0\s", entry), entry
    assert "channel1" not in log  # allocationMode Single: channel 0 only

    stored = rest.get(f"{domains}/{domain['metadata']['name']}")
    assert stored["status"]["status"] == "Ready"
    (member,) = stored["status"]["nodes"]
    assert (member["name"], member["cliqueID"], member["status"]) == (
        config.NODE_NAME,
        FABRIC.replace("/", "."),
        "Ready",
    )
    daemons = core.list_namespaced_pod(NAMESPACE, label_selector=LABEL).items
    assert [(p.spec.node_name, p.status.phase) for p in daemons] == [(config.NODE_NAME, "Running")]
    # It names its peers by DNS name (IMEXDaemonsWithDNSNames, the chart's default): its own name is
    # in the container's /etc/hosts, the file the kubelet mounted, written from inside the container.
    (daemon_pod,) = daemons
    updates = [
        m for m in _log_messages(core, daemon_pod.metadata.name) if m.get("event") == "DNS names updated"
    ]
    assert updates, "the daemon wrote no DNS names"
    assert updates[-1]["hosts"] == "/etc/hosts"
    assert updates[-1]["names"] == {"compute-domain-daemon-0000": daemon_pod.status.pod_ip}

    # Deleting the pod and the domain leaves nothing of it behind.
    core.delete_namespaced_pod(pod["metadata"]["name"], namespace, grace_period_seconds=1)
    rest.delete(f"{domains}/{domain['metadata']['name']}")
    _wait(lambda: not rest.get(domains)["items"], "the domain to be deleted", 120)
    cliques = f"/apis/{GROUP}/v1beta1/namespaces/{NAMESPACE}/computedomaincliques"
    _wait(lambda: not rest.get(cliques)["items"], "its ComputeDomainClique to go", 60)
    _wait(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=LABEL).items, "the daemon pod to go")
    node = core.read_node(config.NODE_NAME)
    assert LABEL not in (node.metadata.labels or {})

    # The chart's controller pod is what set the domain up and cleaned it up.
    key = f"{namespace}/{domain['metadata']['name']}"
    said = {(m.get("event"), m.get("domain")) for m in _log_messages(core, controller_pod.metadata.name)}
    assert {("ComputeDomain set up", key), ("ComputeDomain cleaned up", key)} <= said
