"""The node's moving parts restarting under running workloads: the driver daemon (a DaemonSet pod being
updated or crashing), the kubelet (restarted by an administrator), and the node's ResourceSlices
deleted behind the driver's back. Running pods must keep their GPUs; new pods must still start."""

from __future__ import annotations

import os

import pytest

from e2e import manifests
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import SLICES, GpuNode, node_slices_query, published_devices, published_slices
from e2e.workloads import (
    allocated_devices,
    cdi_devices,
    check_cdi_spec,
    delete_pod,
    distinct_cdi_devices,
    pod_claim,
    pod_path,
    wait_running,
)

pytestmark = pytest.mark.e2e

PREPARED = {"operation": "prepare", "result": "success"}


def apply_example(rest: RestClient, node: GpuNode, namespace: str, path: str) -> None:
    manifests.apply_example(rest, manifests.DEMO / path, namespace, node_name=node.name)


def running_one_gpu_pod(rest: RestClient, node: GpuNode, namespace: str) -> tuple[JsonObject, JsonObject]:
    """The one-gpu example, running: (pod, claim)."""
    apply_example(rest, node, namespace, "one-gpu.yaml")
    pod = wait_running(rest, namespace, "one-gpu")
    return pod, pod_claim(rest, pod, "gpu")


def test_driver_restart_keeps_prepared_claims_and_then_serves_new_and_old_ones(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    pod, claim = running_one_gpu_pod(rest, node, namespace)
    spec_file = node.driver.spec_path(claim["metadata"]["uid"])
    spec_before = spec_file.read_text()

    assert node.driver.restart() == 0, "SIGTERM is a clean shutdown"

    still_running = rest.get(pod_path(namespace, "one-gpu"))
    assert still_running["status"]["phase"] == "Running"
    assert cdi_devices(still_running) == cdi_devices(pod)
    assert spec_file.read_text() == spec_before
    apply_example(rest, node, namespace, "two-gpus.yaml")
    new_claim = pod_claim(rest, wait_running(rest, namespace, "two-gpus"), "gpus")
    assert not set(allocated_devices(new_claim)) & set(allocated_devices(claim))
    check_cdi_spec(node, new_claim)

    delete_pod(rest, namespace, "one-gpu")  # prepared by the daemon's previous run
    assert not spec_file.exists()
    check_cdi_spec(node, new_claim)


def test_kubelet_restart_prepares_running_pods_again_with_the_same_devices(
    rest: RestClient, cluster: ClusterInfo, node: GpuNode, namespace: str
) -> None:
    pod, claim = running_one_gpu_pod(rest, node, namespace)
    spec_file = node.driver.spec_path(claim["metadata"]["uid"])
    spec_before = spec_file.read_text()
    devices_before = published_devices(rest, node.name).keys()
    prepared_before = node.driver.metric("dra_driver_claim_operations_total", **PREPARED)

    assert node.harness.restart() == 0

    # The restarted kubelet calls NodePrepareResources again for the pod it finds running ...
    wait_until(
        lambda: node.driver.metric("dra_driver_claim_operations_total", **PREPARED) > prepared_before,
        timeout_seconds=60,
        waiting_for="the restarted kubelet to prepare the running pod's claim again",
    )
    # ... and, like every kubelet start, deleted the node's slices: the driver publishes them again.
    wait_until(
        lambda: published_devices(rest, node.name).keys() == devices_before,
        timeout_seconds=60,
        waiting_for="the driver to publish its slices again",
    )
    apply_example(rest, node, namespace, "two-gpus.yaml")
    wait_running(rest, namespace, "two-gpus")
    # Distinct: before 1.37 the kubelet itself repeats the ids of a claim it prepares again.
    after = distinct_cdi_devices(rest.get(pod_path(namespace, "one-gpu")), cluster.kube_version)
    assert after == cdi_devices(pod)
    assert spec_file.read_text() == spec_before

    delete_pod(rest, namespace, "one-gpu")  # the restarted kubelet knows the claim from its checkpoint
    assert not spec_file.exists()


def test_deleted_resource_slices_are_published_again_in_a_newer_generation(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    devices_before = published_devices(rest, node.name).keys()
    generation_before = max(item["spec"]["pool"]["generation"] for item in published_slices(rest, node.name))

    rest.request("DELETE", SLICES, query=node_slices_query(node.name))

    def republished() -> list[JsonObject] | None:
        items = published_slices(rest, node.name)
        devices = {device["name"] for item in items for device in item["spec"].get("devices") or []}
        return items if devices == devices_before else None

    items = wait_until(republished, timeout_seconds=60, waiting_for="the driver to publish its slices again")
    # Consumers that still hold a deleted slice must see the new ones as newer, never as older.
    assert all(item["spec"]["pool"]["generation"] > generation_before for item in items)
    _, claim = running_one_gpu_pod(rest, node, namespace)
    check_cdi_spec(node, claim)


def test_pod_waits_while_the_driver_is_down_and_starts_once_it_is_back(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    node.driver.stop()
    # The kubelet deletes the driver's slices only 30 s after it went away: the pod is still scheduled.
    apply_example(rest, node, namespace, "one-gpu.yaml")

    events = f"/api/v1/namespaces/{namespace}/events"
    selector = "involvedObject.name=one-gpu,reason=FailedPrepareDynamicResources"
    event = wait_until(
        lambda: rest.request("GET", events, query={"fieldSelector": selector})["items"],
        timeout_seconds=60,
        waiting_for="the kubelet to report that it cannot prepare the claim",
    )[0]
    # "DRA driver <name> is not registered", or, while the kubelet still holds the vanished plugin's
    # registration, the failed dial of its socket under <plugins>/<name>/.
    assert DRIVER_NAME in event["message"]
    assert rest.get(pod_path(namespace, "one-gpu"))["status"]["phase"] == "Pending"

    node.driver.start()

    pod = wait_running(rest, namespace, "one-gpu")  # the kubelet retries with a backoff of at most 10 s
    check_cdi_spec(node, pod_claim(rest, pod, "gpu"))


def test_two_specs_that_name_one_gpu_after_a_lost_store_are_a_warning_event_on_the_node(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    _, claim = running_one_gpu_pod(rest, node, namespace)
    uid = claim["metadata"]["uid"]
    rogue = "0badc0de-0000-4000-8000-000000000001"  # a claim some earlier mistake left a spec of
    node.driver.stop()
    spec_file = node.driver.spec_path(uid)
    rogue_file = node.driver.spec_path(rogue)
    rogue_file.write_text(spec_file.read_text().replace(uid, rogue))
    later = spec_file.stat().st_mtime + 3600
    os.utime(rogue_file, (later, later))  # written after the pod's: the younger claim
    for lost in node.driver.paths.data.glob("state.db*"):
        lost.unlink()

    node.driver.start()

    selector = f"involvedObject.kind=Node,involvedObject.name={node.name},reason=PreparedClaimsConflict"
    (event,) = wait_until(
        lambda: rest.request("GET", "/api/v1/events", query={"fieldSelector": selector})["items"],
        timeout_seconds=30,
        waiting_for="the driver's Event on the Node",
    )
    assert event["type"] == "Warning"
    assert f"claims {uid} and {rogue} hold one device" in event["message"]
    assert spec_file.exists(), "the pod's claim kept its spec; nothing overwrote it"
    delete_pod(rest, namespace, "one-gpu")
    assert not spec_file.exists()
    node.driver.specs.remove(rogue)
