"""Operating the driver on a real node: a killed plugin container, an upgrade under load, a removal,
and pods going away -- with the kubelet, containerd and the chart doing what they do in a cluster.

The tests run in file order; the last one uninstalls the release the module installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.real_node.driver import NAMESPACE, RELEASE, DriverRelease
from e2e.real_node.gpu_view import (
    allocated_devices,
    container,
    create,
    gpu_claim_template,
    pod_manifest,
    view_of,
    wait_running,
)
from e2e.realnode.images import IMAGES
from e2e.realnode.node import RealNode

pytestmark = pytest.mark.real_node

UPGRADE_PODS = 20
# With many pods at once the kubelet may fetch a claim before the API server's Node authorizer has
# linked it to the node; the fetch is refused, no NodePrepareResources call is made, and the kubelet
# retries. Upstream behaviour of the kubelet and the API server (with or without an upgrade), not a
# prepare of the driver's, which is what the upgrade test counts.
NODE_AUTHORIZER_LAG = "no relationship found between node"


def _one_gpu_pod(api: client.ApiClient, namespace: str, name: str, template: str = "one-gpu") -> None:
    create(
        api,
        namespace,
        pod_manifest(name, {"gpu": {"resourceClaimTemplateName": template}}, [container("app", ["gpu"])]),
    )


def _claim_uid(api: client.ApiClient, namespace: str, pod: str) -> str:
    found = client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
    (status,) = found.status.resource_claim_statuses
    claim = client.ResourceV1Api(api).read_namespaced_resource_claim(status.resource_claim_name, namespace)
    return str(claim.metadata.uid)


def _spec_of(release: DriverRelease, claim_uid: str) -> list[Path]:
    return [p for p in release.cdi_specs() if claim_uid in p.name]


def _wait(condition: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.5)


def _plugin_task_pid(node: RealNode, pod: client.V1Pod) -> int:
    container_id = pod.status.container_statuses[0].container_id.removeprefix("containerd://")
    tasks = node.ctr("tasks", "ls").stdout.splitlines()[1:]
    (pid,) = [int(line.split()[1]) for line in tasks if line.split()[0] == container_id]
    return pid


def _restarts(release: DriverRelease) -> int:
    (pod,) = release.plugin_pods()
    return int(pod.status.container_statuses[0].restart_count) if pod.status.container_statuses else 0


def test_kill_9_of_the_driver_container_keeps_prepared_claims_and_new_pods_start(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    create(real_api, namespace, gpu_claim_template("one-gpu"))
    _one_gpu_pod(real_api, namespace, "before")
    before = view_of(real_api, namespace, "before", "app")
    claim_uid = _claim_uid(real_api, namespace, "before")
    assert _spec_of(driver, claim_uid)

    plugin = driver.wait_ready()
    os.kill(_plugin_task_pid(real_node, plugin), signal.SIGKILL)

    # The kubelet restarts the container in the same pod; it registers and becomes ready again.
    _wait(lambda: _restarts(driver) >= 1, "the kubelet restarted the plugin container")
    driver.wait_ready()
    # The running workload and its prepared claim were never touched.
    assert wait_running(real_api, namespace, "before").status.container_statuses[0].restart_count == 0
    assert _spec_of(driver, claim_uid)
    # And new work is prepared by the restarted plugin.
    _one_gpu_pod(real_api, namespace, "after")
    after = view_of(real_api, namespace, "after", "app")
    assert len(after.gpu_nodes) == 1
    assert after.gpu_nodes.keys() != before.gpu_nodes.keys()


def test_helm_upgrade_to_a_new_tag_while_pods_with_claims_start_fails_no_prepare(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    new_tag = f"{driver.tag}-upgrade"
    real_node.ctr(
        "images", "tag", "--force", f"{IMAGES['driver']}:{driver.tag}", f"{IMAGES['driver']}:{new_tag}"
    )
    template: dict[str, Any] = gpu_claim_template("mig", device_class="mig.dra-driver.dev")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.attributes["gpu.dra-driver.dev"].profile == "1g.10gb"'}}
    ]
    create(real_api, namespace, template)
    for index in range(UPGRADE_PODS):
        _one_gpu_pod(real_api, namespace, f"load-{index}", template="mig")

    upgrade = subprocess.Popen(
        [str(driver.helm), "upgrade", RELEASE, str(driver_chart()), "--namespace", NAMESPACE,
         "--kubeconfig", str(driver.cluster.kubeconfig), *driver.values(tag=new_tag)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    output, _ = upgrade.communicate(timeout=180)
    assert upgrade.returncode == 0, output

    for index in range(UPGRADE_PODS):
        wait_running(real_api, namespace, f"load-{index}", timeout=300)
    new_plugin = driver.wait_ready(image_tag=new_tag, timeout=300)
    assert new_plugin.spec.containers[0].image == f"{IMAGES['driver']}:{new_tag}"
    events = client.CoreV1Api(real_api).list_namespaced_event(namespace).items
    failed = [
        f"{e.involved_object.name}: {e.reason}: {e.message}"
        for e in events
        if e.type == "Warning"
        and "prepare" in (e.reason + e.message).lower()
        and NODE_AUTHORIZER_LAG not in e.message
    ]
    assert not failed, "\n".join(failed)
    devices = {
        d for i in range(UPGRADE_PODS) for d in allocated_devices(real_api, namespace, f"load-{i}")["gpu"]
    }
    assert len(devices) == UPGRADE_PODS


def test_deleting_a_pod_unprepares_its_claim_and_the_runtime_forgets_its_devices(
    driver: DriverRelease, real_node: RealNode, real_api: client.ApiClient, namespace: str
) -> None:
    create(real_api, namespace, gpu_claim_template("one-gpu"))
    _one_gpu_pod(real_api, namespace, "short-lived")
    view_of(real_api, namespace, "short-lived", "app")
    claim_uid = _claim_uid(real_api, namespace, "short-lived")
    found = client.CoreV1Api(real_api).read_namespaced_pod("short-lived", namespace)
    container_id = found.status.container_statuses[0].container_id.removeprefix("containerd://")
    assert _spec_of(driver, claim_uid)

    client.CoreV1Api(real_api).delete_namespaced_pod("short-lived", namespace, grace_period_seconds=1)

    _wait(lambda: not _spec_of(driver, claim_uid), "the claim's CDI spec is gone")
    _wait(
        lambda: container_id not in real_node.ctr("containers", "ls", "--quiet").stdout.split(),
        "containerd forgot the container",
    )


def test_helm_uninstall_leaves_no_slices_specs_or_sockets(
    driver: DriverRelease, real_api: client.ApiClient
) -> None:
    # The earlier tests' pods are gone (their namespaces are deleted): no claim is prepared now, so
    # no CDI spec may stay. A claim still in use would keep its spec, as it must.
    core = client.CoreV1Api(real_api)
    _wait(
        lambda: all(p.metadata.namespace == NAMESPACE for p in core.list_pod_for_all_namespaces().items),
        "the workloads are gone",
    )
    _wait(lambda: not driver.cdi_specs(), "every claim is unprepared")
    assert driver.slices()
    assert driver.sockets()

    driver.uninstall()

    _wait(lambda: not driver.slices(), "the driver's ResourceSlices are gone", timeout=60)
    _wait(lambda: not driver.plugin_pods(), "the plugin pod is gone", timeout=60)
    assert driver.cdi_specs() == []
    assert driver.sockets() == []


def driver_chart() -> Path:
    from e2e.real_node.driver import CHART

    return CHART
