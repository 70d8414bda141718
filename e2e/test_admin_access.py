"""Admin access and the node maintenance workflow of docs/maintenance.md, end to end: the example YAML of
docs/examples/maintenance applied to the real control plane, the scheduler honouring an administrator's
DeviceTaintRule, and the driver handing a diagnostic pod a GPU that a workload keeps using."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from e2e import manifests
from e2e.claims import claim_of, gpu_uuid, pod_using, run_on_gpu, wait_unschedulable
from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient
from e2e.cluster.features import device_taint_rule_version
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode
from e2e.manifests import EXAMPLES, collection
from e2e.workloads import (
    allocated_devices,
    delete_pod,
    pod_claim,
    pod_event_saying,
    pod_path,
    wait_gone,
    wait_running,
)

pytestmark = pytest.mark.e2e

MAINTENANCE = EXAMPLES / "maintenance"
# What the examples name, and the tests replace with their node's, GPU's and namespace's.
EXAMPLE_NODE, EXAMPLE_DEVICE, EXAMPLE_NAMESPACE = "gpu-node-1", "gpu-3", "gpu-maintenance"
EXAMPLE_UUID = "GPU-5ecb8a9e-0000-0000-0000-000000000003"
MIG_CLASS = "mig.dra-driver.dev"

Example = Callable[..., list[JsonObject]]


@pytest.fixture(scope="module")
def taint_rule_version(cluster: ClusterInfo) -> str:
    """Where this release serves DeviceTaintRule (the examples say v1, as 1.37 does)."""
    return device_taint_rule_version(cluster.kube_version)


@pytest.fixture(scope="module")
def taint_rules_collection(taint_rule_version: str) -> str:
    return f"/apis/resource.k8s.io/{taint_rule_version}/devicetaintrules"


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A simulated DGX H100 whose GPU 3 offers no MIG partitions (see the first test), the others do."""
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-admin-access"),
        "node-admin-access",
        driver_args=["--mig-partitions=0,1,2,4,5,6,7"],
    )
    with node.running():
        yield node


@pytest.fixture
def admin_namespace(rest: RestClient, node: GpuNode) -> Iterator[str]:
    """docs/examples/maintenance/namespace.yaml under a name of the test's own; its pods are gone
    (unprepared) before the node is checked idle."""
    (namespace,) = yaml.safe_load_all((MAINTENANCE / "namespace.yaml").read_text())
    namespace["metadata"]["name"] = name = f"maintenance-{uuid.uuid4().hex[:8]}"
    rest.create("/api/v1/namespaces", namespace)
    yield name
    rest.request("DELETE", f"/api/v1/namespaces/{name}/pods", query={"gracePeriodSeconds": "0"})
    rest.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture
def example(node: GpuNode, admin_namespace: str, taint_rule_version: str) -> Example:
    """`example(file, device=..., uuid=...)`: a maintenance example for this node, GPU and namespace
    (a DeviceTaintRule in the version this release serves, as docs/maintenance.md tells users)."""

    def load(file: str, *, device: str = EXAMPLE_DEVICE, uuid: str = EXAMPLE_UUID) -> list[JsonObject]:
        text = (MAINTENANCE / file).read_text()
        text = text.replace(EXAMPLE_NODE, node.name).replace(EXAMPLE_NAMESPACE, admin_namespace)
        text = text.replace(EXAMPLE_UUID, uuid).replace(EXAMPLE_DEVICE, device)
        documents = [document for document in yaml.safe_load_all(text) if document]
        for document in documents:
            if document["kind"] == "DeviceTaintRule":
                document["apiVersion"] = f"resource.k8s.io/{taint_rule_version}"
        return documents

    return load


@pytest.fixture
def taint_rules(rest: RestClient, taint_rules_collection: str) -> Iterator[list[str]]:
    """Names of DeviceTaintRules the test created; whatever is left of them is deleted afterwards."""
    created: list[str] = []
    yield created
    for name in created:
        try:
            rest.delete(f"{taint_rules_collection}/{name}")
        except ApiError as error:
            if error.status != 404:
                raise


def create_all(rest: RestClient, objects: list[JsonObject]) -> None:
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        if obj["kind"] == "DeviceTaintRule":
            version = obj["apiVersion"].removeprefix("resource.k8s.io/")
            rest.create(f"/apis/resource.k8s.io/{version}/devicetaintrules", obj)
        else:
            rest.create(collection(obj["kind"], namespace), obj)


def spec_env(node: GpuNode, claim: JsonObject, device: str) -> list[str]:
    uid = claim["metadata"]["uid"]
    spec = json.loads(node.driver.spec_path(uid).read_text())
    (edits,) = [d["containerEdits"] for d in spec["devices"] if d["name"] == f"{uid}-{device}"]
    env: list[str] = edits["env"]
    return env


@pytest.mark.kube_versions
def test_a_cordoned_gpu_is_diagnosed_while_its_workload_runs_and_takes_new_work_once_lifted(
    rest: RestClient,
    node: GpuNode,
    namespace: str,
    admin_namespace: str,
    example: Example,
    taint_rules: list[str],
    taint_rules_collection: str,
) -> None:
    # GPU 3 offers no MIG partitions: the Kubernetes 1.37 scheduler counts an admin-access claim
    # against a partitionable GPU's counters, which its workload holds (kubernetes/kubernetes#140729).
    uuid = gpu_uuid(node, 3)
    run_on_gpu(rest, node, namespace, "workload", uuid)
    workload = wait_running(rest, namespace, "workload")
    workload_claim = pod_claim(rest, workload, "gpu")
    workload_spec = node.driver.spec_path(workload_claim["metadata"]["uid"]).read_text()

    # 1. Cordon the GPU.
    (rule,) = example("cordon-gpu.yaml")
    create_all(rest, [rule])
    taint_rules.append(rule["metadata"]["name"])

    # 2. A diagnostic pod gets the very GPU the workload holds, and is told it has admin access.
    create_all(rest, example("diagnostics.yaml", uuid=uuid))
    diagnostics = wait_running(rest, admin_namespace, "gpu-diagnostics")
    diagnostics_claim = pod_claim(rest, diagnostics, "gpu")
    (result,) = diagnostics_claim["status"]["allocation"]["devices"]["results"]
    assert (result["device"], result.get("adminAccess")) == ("gpu-3", True)
    env = spec_env(node, diagnostics_claim, "gpu-3")
    assert "DRA_GPU_ADMIN_ACCESS_GPU_3=true" in env
    assert f"DRA_GPU_UUID_GPU_3={uuid}" in env
    assert not any("ADMIN_ACCESS" in variable for variable in spec_env(node, workload_claim, "gpu-3"))

    # 3. Diagnostics done: the workload's claim is as it was.
    delete_pod(rest, admin_namespace, "gpu-diagnostics")
    assert not node.driver.spec_path(diagnostics_claim["metadata"]["uid"]).exists()
    assert node.driver.spec_path(workload_claim["metadata"]["uid"]).read_text() == workload_spec
    assert rest.get(pod_path(namespace, "workload"))["status"]["phase"] == "Running"

    # 4. The workload ends; the cordon keeps new work off the free GPU.
    delete_pod(rest, namespace, "workload")
    rest.delete(f"{collection('ResourceClaim', namespace)}/workload")
    wait_gone(rest, f"{collection('ResourceClaim', namespace)}/workload")
    run_on_gpu(rest, node, namespace, "newcomer", uuid)
    wait_unschedulable(rest, namespace, "newcomer")
    assert not claim_of(rest, namespace, "newcomer").get("status", {}).get("allocation")

    # 5. Lift the cordon.
    rest.delete(f"{taint_rules_collection}/{rule['metadata']['name']}")
    newcomer = wait_running(rest, namespace, "newcomer")
    assert allocated_devices(pod_claim(rest, newcomer, "gpu")) == ["gpu-3"]


def test_outside_an_admin_namespace_the_api_server_refuses_an_admin_access_claim(
    rest: RestClient, namespace: str, example: Example
) -> None:
    claim, _pod = example("diagnostics.yaml")
    claim["metadata"]["namespace"] = namespace  # an ordinary namespace, without the label
    with pytest.raises(ApiError) as refused:
        rest.create(collection("ResourceClaim", namespace), claim)
    assert refused.value.status == 422
    assert (
        "admin access to devices requires the `resource.kubernetes.io/admin-access: true` label on the "
        "containing namespace" in refused.value.message
    )


def _mig_claim(name: str, parent_uuid: str, *, admin_access: bool) -> JsonObject:
    """A claim for the one 7g.80gb placement of a GPU (it has exactly one)."""
    attributes = f'device.attributes["{DRIVER_NAME}"]'
    expression = f'{attributes}.profile == "7g.80gb" && {attributes}.parentUUID == "{parent_uuid}"'
    exactly: JsonObject = {"deviceClassName": MIG_CLASS, "selectors": [{"cel": {"expression": expression}}]}
    if admin_access:
        exactly |= {"adminAccess": True, "tolerations": [{"operator": "Exists"}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def test_admin_access_to_a_mig_device_that_is_gone_fails_only_its_own_pod_with_an_event_saying_why(
    rest: RestClient, node: GpuNode, namespace: str, admin_namespace: str, mig_device_class: str
) -> None:
    parent = gpu_uuid(node, 5)
    job_objects = [_mig_claim("job", parent, admin_access=False), pod_using("job", "job")]
    manifests.apply(rest, manifests.pinned(job_objects, node.name), namespace)
    job = wait_running(rest, namespace, "job")
    (device,) = allocated_devices(pod_claim(rest, job, "gpu"))
    delete_pod(rest, namespace, "job")  # the job ends: its MIG device is destroyed
    job_claim = f"{collection('ResourceClaim', namespace)}/job"
    rest.delete(job_claim)  # and its claim with it, which held the placement's counters
    wait_gone(rest, job_claim)
    assert not [m for g in node.driver.simulated_gpus().gpus for m in g.mig_devices]

    looking = [_mig_claim("inspect", parent, admin_access=True), pod_using("inspect", "inspect")]
    manifests.apply(rest, manifests.pinned(looking, node.name), admin_namespace)
    reason = f"device {device}: admin access to a MIG placement needs its MIG device to exist"
    wait_until(
        lambda: pod_event_saying(rest, admin_namespace, "inspect", reason),
        timeout_seconds=60,
        waiting_for="the admin pod's prepare to fail",
    )
    assert rest.get(pod_path(admin_namespace, "inspect"))["status"]["phase"] == "Pending"

    run_on_gpu(rest, node, namespace, "unaffected", gpu_uuid(node, 6))  # the driver serves others meanwhile
    wait_running(rest, namespace, "unaffected")
    assert node.driver.daemon.running
