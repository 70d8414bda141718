"""A ComputeDomain on the real node: NVIDIA's channel-injection example, and the pod's container
sees its IMEX channel device node, created by runc from the CDI spec the compute-domain driver
wrote once the domain's IMEX daemon -- a pod of its own, in containerd -- reported Ready.

The chart is installed as NVIDIA's stand-in (driverName gpu.nvidia.com) on a simulated GB200 NVL72
tray, so the example applies as NVIDIA's users write it (with this suite's image: nothing is
pulled). Real here: the kubelet, containerd and runc running the plugin, the IMEX daemon pod (the
driver's image, `dra-driver compute-domain-daemon`) and the workload. The controller runs as a
process on the host, with the chart's account: this control plane has no Deployment controller
to run the chart's Deployment.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from kubernetes import client

from e2e import manifests
from e2e.cluster import ClusterInfo
from e2e.cluster.credentials import write_kubeconfig
from e2e.cluster.tokens import mint_service_account_token
from e2e.daemon import Daemon
from e2e.real_node.driver import CHART, NAMESPACE, RELEASE, DriverRelease
from e2e.realnode import config
from e2e.realnode.images import IMAGES, chart_app_version
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

DRIVER = "gpu.nvidia.com"
GROUP = "resource.nvidia.com"
LABEL = f"{GROUP}/computeDomain"
FABRIC = "6f1c2b7e-3d4a-4e5f-8a9b-0c1d2e3f4a5b/1"
CONTROLLER_ACCOUNT = f"{RELEASE}-compute-domain-controller"
SIMULATED_CHANNEL_MAJOR = 234  # the simulator's nvidia-caps-imex-channels major
EXAMPLE = manifests.EXAMPLES / "compute-domain" / "channel-injection.yaml"

_T = TypeVar("_T")


def _wait(probe: Callable[[], _T | None], what: str, timeout: float = 180) -> _T:
    deadline = time.monotonic() + timeout
    while True:
        found = probe()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tray(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart as gpu.nvidia.com on one GB200 tray in an NVLink clique."""
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
        release.uninstall()


@pytest.fixture(scope="module")
def controller(
    real_cluster: ClusterInfo, tray: DriverRelease, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Daemon]:
    base = tmp_path_factory.mktemp("cd-controller")
    with real_cluster.api_client() as api:
        token = mint_service_account_token(api, NAMESPACE, CONTROLLER_ACCOUNT, expiration_seconds=3600)
    kubeconfig = base / "kubeconfig"
    write_kubeconfig(
        kubeconfig,
        server=real_cluster.server,
        ca_certificate=real_cluster.ca_file.read_bytes(),
        user=CONTROLLER_ACCOUNT,
        token=token,
    )
    daemon = Daemon("compute-domain-controller", base / "controller.log")
    argv = [
        sys.executable, "-m", "dra_driver", "compute-domain-controller",
        f"--driver-name={DRIVER}",
        f"--namespace={NAMESPACE}",
        f"--daemon-image={IMAGES['driver']}:{tray.tag}",
        f"--kubeconfig={kubeconfig}",
        f"--lease-name={CONTROLLER_ACCOUNT}",
        "--log-format=console",
    ]  # fmt: skip
    daemon.start(argv, lambda offset: "controller running" in daemon.log_since(offset), timeout_seconds=60)
    try:
        yield daemon
    finally:
        # Domains go before their controller: one left with its finalizer would hold the CRD's
        # deletion at `helm uninstall`.
        rest = real_cluster.rest()
        for item in rest.get(f"/apis/{GROUP}/v1beta1/computedomains")["items"]:
            meta = item["metadata"]
            rest.delete(f"/apis/{GROUP}/v1beta1/namespaces/{meta['namespace']}/computedomains/{meta['name']}")
        try:
            _wait(lambda: not rest.get(f"/apis/{GROUP}/v1beta1/computedomains")["items"], "domains to go", 60)
        finally:
            daemon.stop()


def _example(image: str) -> list[dict[str, Any]]:
    objects = manifests.load(EXAMPLE)
    for obj in objects:
        for container in obj.get("spec", {}).get("containers", []):
            container["image"] = image
    return objects


def test_a_compute_domain_channel_claim_gives_the_pod_its_imex_channel_device(
    tray: DriverRelease, controller: Daemon, real_api: client.ApiClient, namespace: str
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

    # Deleting the pod and the domain leaves nothing of it behind.
    core.delete_namespaced_pod(pod["metadata"]["name"], namespace, grace_period_seconds=1)
    rest.delete(f"{domains}/{domain['metadata']['name']}")
    _wait(lambda: not rest.get(domains)["items"], "the domain to be deleted", 120)
    cliques = f"/apis/{GROUP}/v1beta1/namespaces/{NAMESPACE}/computedomaincliques"
    _wait(lambda: not rest.get(cliques)["items"], "its ComputeDomainClique to go", 60)
    _wait(lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=LABEL).items, "the daemon pod to go")
    node = core.read_node(config.NODE_NAME)
    assert LABEL not in (node.metadata.labels or {})
