"""GPU workloads end to end: the documented examples applied to the real control plane, scheduled onto
a simulated DGX H100 whose kubelet (the harness, i.e. the kubelet's own DRA code) calls the driver
daemon; checked where a user would look: the pod, its claim, the CDI ids handed to the runtime, and
the CDI spec on the node."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from e2e import manifests
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode
from e2e.workloads import (
    allocated_devices,
    cdi_devices,
    check_cdi_spec,
    delete_pod,
    distinct_cdi_devices,
    expected_cdi_ids,
    pod_claim,
    wait_running,
)

pytestmark = pytest.mark.e2e


def apply_example(rest: RestClient, node: GpuNode, namespace: str, path: str) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / path, namespace, node_name=node.name)


@pytest.mark.kube_versions
def test_pod_with_one_gpu_gets_the_allocated_gpu_and_releases_it_when_deleted(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    apply_example(rest, node, namespace, "demo/one-gpu.yaml")

    pod = wait_running(rest, namespace, "one-gpu")
    claim = pod_claim(rest, pod, "gpu")
    assert len(allocated_devices(claim)) == 1
    assert cdi_devices(pod) == {"app": expected_cdi_ids(claim)}
    check_cdi_spec(node, claim)

    delete_pod(rest, namespace, "one-gpu")
    assert not node.driver.spec_path(claim["metadata"]["uid"]).exists()


def test_two_gpus_in_one_container_are_two_distinct_gpus(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    apply_example(rest, node, namespace, "demo/two-gpus.yaml")

    pod = wait_running(rest, namespace, "two-gpus")
    claim = pod_claim(rest, pod, "gpus")
    devices = allocated_devices(claim)
    assert len(set(devices)) == 2
    assert cdi_devices(pod) == {"app": expected_cdi_ids(claim)}
    spec = check_cdi_spec(node, claim)
    uuids = {env for device in spec["devices"] for env in device["containerEdits"]["env"] if "_UUID_" in env}
    assert len(uuids) == 2


def test_a_shared_claim_gives_both_pods_the_same_gpu_until_the_last_one_is_gone(
    rest: RestClient, cluster: ClusterInfo, node: GpuNode, namespace: str
) -> None:
    apply_example(rest, node, namespace, "demo/shared-claim.yaml")

    first, second = wait_running(rest, namespace, "shared-a"), wait_running(rest, namespace, "shared-b")
    claim = pod_claim(rest, first, "gpu")
    assert len(allocated_devices(claim)) == 1
    # Distinct: before 1.37 the kubelet itself may repeat ids when both pods start at once.
    handed = [distinct_cdi_devices(pod, cluster.kube_version) for pod in (first, second)]
    assert handed[0] == handed[1] == {"app": expected_cdi_ids(claim)}
    check_cdi_spec(node, claim)

    delete_pod(rest, namespace, "shared-a")
    check_cdi_spec(node, claim)  # still in use by shared-b: still prepared
    delete_pod(rest, namespace, "shared-b")
    assert not node.driver.spec_path(claim["metadata"]["uid"]).exists()


@pytest.mark.kube_versions
def test_time_sliced_gpu_is_shared_by_two_containers_and_announced_to_them(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    apply_example(rest, node, namespace, "time-sliced-gpu.yaml")

    pod = wait_running(rest, namespace, "time-sliced")
    claim = pod_claim(rest, pod, "gpu")
    (device,) = allocated_devices(claim)
    ids = expected_cdi_ids(claim)
    assert cdi_devices(pod) == {"trainer": ids, "evaluator": ids}
    spec = check_cdi_spec(node, claim)
    (edits,) = [d["containerEdits"] for d in spec["devices"]]
    suffix = device.upper().replace("-", "_")
    assert f"DRA_GPU_SHARING_STRATEGY_{suffix}=TimeSlicing" in edits["env"]
    assert f"DRA_GPU_TIME_SLICE_INTERVAL_{suffix}=Long" in edits["env"]


def _with_parameters(objects: list[JsonObject], change: dict[str, Any]) -> list[JsonObject]:
    """The time-sliced example with its GpuConfig parameters updated by `change` (None removes)."""
    objects = copy.deepcopy(objects)
    (template,) = manifests.of_kind(objects, "ResourceClaimTemplate")
    parameters = template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    for key, value in change.items():
        if value is None:
            parameters.pop(key)
        else:
            parameters[key] = value
    return objects


@pytest.mark.parametrize(
    ("change", "named_in_event"),
    [
        pytest.param({"timeslicing": {"interval": "Long"}}, "timeslicing", id="unknown-field"),
        pytest.param(
            {"apiVersion": "resource.nvidia.com/v1"},
            "'resource.nvidia.com/v1' is not served",
            id="foreign-api",
        ),
        pytest.param(
            {"sharing": {"strategy": "Exclusive", "timeSlicing": {"interval": "Long"}}},
            "timeSlicing is only valid with strategy TimeSlicing",
            id="settings-without-strategy",
        ),
    ],
)
def test_invalid_opaque_config_keeps_only_its_own_pod_pending_with_an_event_naming_the_problem(
    rest: RestClient, node: GpuNode, namespace: str, change: dict[str, Any], named_in_event: str
) -> None:
    example = manifests.pinned(manifests.load(manifests.EXAMPLES / "time-sliced-gpu.yaml"), node.name)
    manifests.apply(rest, _with_parameters(example, change), namespace)
    apply_example(rest, node, namespace, "demo/one-gpu.yaml")

    events = f"/api/v1/namespaces/{namespace}/events"
    selector = "involvedObject.kind=Pod,involvedObject.name=time-sliced,reason=FailedPrepareDynamicResources"

    def failure_event() -> JsonObject | None:
        items: list[JsonObject] = rest.request("GET", events, query={"fieldSelector": selector})["items"]
        return items[0] if items else None

    event = wait_until(failure_event, timeout_seconds=60, waiting_for="a FailedPrepareDynamicResources event")
    assert event["type"] == "Warning"
    assert event["source"] == {"component": "kubelet", "host": node.name}
    assert named_in_event in event["message"]

    healthy = wait_running(rest, namespace, "one-gpu")  # the other pod on the node is not held up
    check_cdi_spec(node, pod_claim(rest, healthy, "gpu"))
    bad_pod = rest.get(f"/api/v1/namespaces/{namespace}/pods/time-sliced")
    assert bad_pod["status"]["phase"] == "Pending"
    bad_claim = pod_claim(rest, bad_pod, "gpu")
    assert allocated_devices(bad_claim), "the scheduler allocates; the driver refuses at prepare"
    assert not node.driver.spec_path(bad_claim["metadata"]["uid"]).exists()
