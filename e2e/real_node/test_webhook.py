"""The chart's admission webhook on the real node (webhook.enabled=true), as a user meets it: `kubectl
apply` of a claim with a misspelt opaque config is refused with the message prepare gives, and while
the webhook is down (failurePolicy Ignore, set here; the chart's default is Fail) the same claim is
created and its pod's prepare fails with that message.

Real here: the chart's Secret (its self-signed certificate, made by Helm at install; no
cert-manager), Deployment, Service and ValidatingWebhookConfiguration; the webhook pod in containerd,
Ready by its HTTPS readiness probe; its EndpointSlice, made by the upstream controller; and the API
server calling the Service at the pod's address. The pods live in the node's network namespace: the
API server gets there as through Konnectivity, over its egress selector's HTTP CONNECT to the node's
proxy (e2e/realnode/api_proxy.py).
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import yaml
from kubernetes import client

from e2e.cluster import ClusterInfo, ControlPlaneBinaries
from e2e.daemon import wait_until
from e2e.real_node.driver import CHART, DRIVER_NAME, NAMESPACE, RELEASE, DriverRelease
from e2e.realnode.images import IMAGES, chart_app_version
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

WEBHOOK = f"{RELEASE}-webhook"  # the Deployment, Service, Secret and ValidatingWebhookConfiguration
# What the driver says of the misspelt config below, at prepare and at admission alike.
PROBLEM = "config[0] (FromClaim, all requests): sharing.timeslicing: Extra inputs are not permitted"
MISSPELT = {
    "apiVersion": "resource.dra-driver.dev/v1alpha1",
    "kind": "GpuConfig",
    "sharing": {"strategy": "TimeSlicing", "timeslicing": {"interval": "Long"}},
}

_T = TypeVar("_T")


def _wait(probe: Callable[[], _T | None], what: str, timeout: float = 120) -> _T:
    return wait_until(probe, timeout_seconds=timeout, waiting_for=what)


@pytest.fixture(scope="module")
def checked(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart with its webhook, once the webhook's pod is Ready behind its Service."""
    release = DriverRelease(real_cluster, real_node, helm, chart_app_version())
    release.helm_run(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace", *release.values(),
        "--set", "webhook.enabled=true", "--set", "webhook.failurePolicy=Ignore",
        "--set", "webhook.replicas=1",
    )  # fmt: skip
    try:
        release.wait_ready()
        _wait_available(release, 1)
        yield release
    finally:
        release.uninstall()


def _wait_available(release: DriverRelease, replicas: int) -> None:
    with release.cluster.api_client() as api:
        apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
        selector = f"app.kubernetes.io/name={RELEASE}-webhook"

        def settled() -> bool:
            status = apps.read_namespaced_deployment(WEBHOOK, NAMESPACE).status
            pods = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
            return (status.available_replicas or 0) == replicas and len(pods) == replicas

        try:
            _wait(settled, f"{replicas} webhook pod(s) available and no other")
        except TimeoutError as err:
            raise TimeoutError(f"{err}\n{release.node.failure_summary()}") from None


@pytest.fixture
def kubectl(
    real_cluster: ClusterInfo, control_plane_binaries: ControlPlaneBinaries
) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        argv = [str(control_plane_binaries.kubectl), "--kubeconfig", str(real_cluster.kubeconfig), *args]
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60, check=False)

    return run


def _claim(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER_NAME}}],
                    "config": [
                        {"requests": ["gpu"], "opaque": {"driver": DRIVER_NAME, "parameters": MISSPELT}}
                    ],
                }
            },
        }
    )


def test_kubectl_apply_of_a_misspelt_config_is_refused_with_prepares_message(
    checked: DriverRelease, kubectl: Callable[..., subprocess.CompletedProcess[str]], namespace: str
) -> None:
    def refused() -> str | None:
        name = f"bad-{uuid.uuid4().hex[:6]}"
        applied = kubectl("apply", "--namespace", namespace, "-f", "-", stdin=_claim(name))
        if applied.returncode == 0:  # failurePolicy Ignore: the API server had not reached it yet
            kubectl("delete", "resourceclaim", name, "--namespace", namespace, "--wait=false")
            return None
        return applied.stderr

    stderr = _wait(refused, "the webhook to refuse the claim", 60)
    assert (
        f'admission webhook "opaque-config.{DRIVER_NAME}" denied the request: '
        f"opaque config for {DRIVER_NAME}: {PROBLEM}"
    ) in stderr, stderr
    assert kubectl("get", "resourceclaims", "--namespace", namespace, "-o", "name").stdout == ""


def test_while_the_webhook_is_down_the_claim_is_created_and_prepare_says_the_same(
    checked: DriverRelease,
    kubectl: Callable[..., subprocess.CompletedProcess[str]],
    real_api: client.ApiClient,
    namespace: str,
) -> None:
    assert kubectl("scale", "deployment", WEBHOOK, "--namespace", NAMESPACE, "--replicas=0").returncode == 0
    try:
        _wait_available(checked, 0)
        assert (
            kubectl("apply", "--namespace", namespace, "-f", "-", stdin=_claim("unchecked")).returncode == 0
        )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "unchecked"},
            "spec": {
                "containers": [
                    {
                        "name": "ctr",
                        "image": f"{IMAGES['workload']}:{checked.tag}",
                        "imagePullPolicy": "Never",
                        "command": ["sleep", "3600"],
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "unchecked"}],
            },
        }
        core = client.CoreV1Api(real_api)
        core.create_namespaced_pod(namespace, pod)
        selector = "involvedObject.name=unchecked,reason=FailedPrepareDynamicResources"

        def prepare_failed() -> str | None:
            events = core.list_namespaced_event(namespace, field_selector=selector).items
            return events[0].message if events else None

        message = _wait(prepare_failed, "a FailedPrepareDynamicResources event")
        assert PROBLEM in message, message
        assert core.read_namespaced_pod("unchecked", namespace).status.phase == "Pending"
    finally:
        kubectl("scale", "deployment", WEBHOOK, "--namespace", NAMESPACE, "--replicas=1")
        _wait_available(checked, 1)
