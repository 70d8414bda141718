"""Admin access to a partitioned GPU in use, through its maintenance device, with the real scheduler.

Kubernetes 1.37 counts an admin-access claim against the shared counters of the device it asks for
(kubernetes/kubernetes#140729): a diagnostic claim for a GPU whose MIG device a workload holds waits
for the workload. Each GPU's counter-free maintenance device (gpu-<minor>-maintenance) in the chart's
maintenance class gets it there at once, and the chart's admission policy keeps every request without
adminAccess away from that class, so ordinary claims stay exclusive.

The chart's DeviceClasses and policy are rendered by helm and applied as helm would, for a driver name
of this module's own (classes and policies are cluster-wide).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from e2e import manifests
from e2e.claims import gpu_uuid, pod_using, wait_unschedulable
from e2e.cluster import ApiError, ClusterInfo, JsonObject, RestClient
from e2e.cluster.binaries import REPO_ROOT, build_outputs
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode
from e2e.manifests import collection
from e2e.workloads import delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.e2e

DRIVER = "gpu.maint-e2e.dev"
GPU_CLASS, MIG_CLASS, MAINTENANCE_CLASS = DRIVER, "mig.maint-e2e.dev", "maintenance.maint-e2e.dev"
CHART = REPO_ROOT / "charts" / "dra-driver-gpu"


@pytest.fixture(scope="module")
def chart_classes_and_policy(cluster: ClusterInfo) -> Iterator[None]:
    """templates/deviceclasses.yaml and templates/maintenance.yaml, rendered and applied."""
    helm = Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"
    rendered = subprocess.run(
        [
            *(
                str(helm),
                "template",
                "m",
                str(CHART),
                "--namespace",
                "dra-driver-gpu",
                "--set",
                f"driverName={DRIVER}",
            ),
            *("--show-only", "templates/deviceclasses.yaml", "--show-only", "templates/maintenance.yaml"),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    objects = [document for document in yaml.safe_load_all(rendered) if document]
    rest = cluster.rest()
    for obj in objects:
        rest.create(collection(obj["kind"]), obj)
    _wait_enforced(rest)
    yield
    for obj in reversed(objects):
        rest.delete(manifests.object_path(obj))


def _wait_enforced(rest: RestClient) -> None:
    """The API server loads a new policy a moment after it is created: probe with a dry run."""
    probe = {**_claim("probe", MAINTENANCE_CLASS, None, admin_access=False), "kind": "ResourceClaim"}

    def enforced() -> bool:
        try:
            rest.request("POST", collection("ResourceClaim", "default"), probe, query={"dryRun": "All"})
        except ApiError as error:
            if error.status == 403 and "ValidatingAdmissionPolicy" in error.message:
                return True
            raise
        return False

    wait_until(enforced, timeout_seconds=30, waiting_for="the API server to enforce the maintenance policy")


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    chart_classes_and_policy: None,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A simulated DGX H100 as installed by default: partitions on every GPU, maintenance devices on."""
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-maint"),
        "node-maint",
        driver_name=DRIVER,
    )
    with node.running():
        yield node


@pytest.fixture
def admin_namespace(rest: RestClient, node: GpuNode) -> Iterator[str]:
    name = f"maintenance-{uuid.uuid4().hex[:8]}"
    labels = {"resource.kubernetes.io/admin-access": "true"}
    rest.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels}})
    yield name
    rest.request("DELETE", f"/api/v1/namespaces/{name}/pods", query={"gracePeriodSeconds": "0"})
    rest.delete(f"/api/v1/namespaces/{name}")


def _claim(name: str, device_class: str, selector: str | None, *, admin_access: bool) -> JsonObject:
    exactly: JsonObject = {"deviceClassName": device_class}
    if selector:
        exactly["selectors"] = [{"cel": {"expression": selector}}]
    if admin_access:
        exactly |= {"adminAccess": True, "tolerations": [{"operator": "Exists"}]}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def by_uuid(gpu: str) -> str:
    return f'device.attributes["{DRIVER}"].uuid == "{gpu}"'


def run(rest: RestClient, node: GpuNode, namespace: str, claim: JsonObject) -> None:
    name = claim["metadata"]["name"]
    manifests.apply(rest, manifests.pinned([claim, pod_using(name, name)], node.name), namespace)


@pytest.mark.kube_versions
def test_admin_access_reaches_a_gpu_whose_mig_device_a_workload_holds(
    rest: RestClient, node: GpuNode, namespace: str, admin_namespace: str
) -> None:
    gpu0 = gpu_uuid(node, 0)
    attributes = f'device.attributes["{DRIVER}"]'
    mig = f'{attributes}.parentUUID == "{gpu0}" && {attributes}.profile == "3g.40gb"'
    run(rest, node, namespace, _claim("workload", MIG_CLASS, mig, admin_access=False))
    workload = pod_claim(rest, wait_running(rest, namespace, "workload"), "gpu")

    # The upstream bug, as a canary: admin access through the GPU class waits for the workload.
    # When this starts running, Kubernetes has the fix: set maintenanceDevices=false (docs/maintenance.md).
    run(rest, node, admin_namespace, _claim("via-gpu-class", GPU_CLASS, by_uuid(gpu0), admin_access=True))
    wait_unschedulable(rest, admin_namespace, "via-gpu-class")

    # Through the maintenance device (docs/examples/maintenance/diagnostics-in-use.yaml) it runs at
    # once, next to the workload, on the same GPU.
    text = (manifests.EXAMPLES / "maintenance" / "diagnostics-in-use.yaml").read_text()
    for example, ours in [
        ("maintenance.dra-driver.dev", MAINTENANCE_CLASS),
        ("gpu.dra-driver.dev", DRIVER),
        ("GPU-5ecb8a9e-0000-0000-0000-000000000003", gpu0),
        ("gpu-node-1", node.name),
        ("gpu-maintenance", admin_namespace),
    ]:
        text = text.replace(example, ours)
    manifests.apply(rest, [d for d in yaml.safe_load_all(text) if d], admin_namespace)
    diagnostics = pod_claim(rest, wait_running(rest, admin_namespace, "gpu-diagnostics-in-use"), "gpu")
    (result,) = diagnostics["status"]["allocation"]["devices"]["results"]
    assert (result["device"], result.get("adminAccess")) == ("gpu-0-maintenance", True)
    spec = json.loads(node.driver.spec_path(diagnostics["metadata"]["uid"]).read_text())
    (device,) = spec["devices"]
    assert [n["path"] for n in device["containerEdits"]["deviceNodes"]] == ["/dev/nvidia0"]
    assert "DRA_GPU_ADMIN_ACCESS_GPU_0_MAINTENANCE=true" in device["containerEdits"]["env"]
    assert f"DRA_GPU_UUID_GPU_0_MAINTENANCE={gpu0}" in device["containerEdits"]["env"]

    delete_pod(rest, admin_namespace, "gpu-diagnostics-in-use")
    assert not node.driver.spec_path(diagnostics["metadata"]["uid"]).exists()
    assert node.driver.spec_path(workload["metadata"]["uid"]).exists()  # the workload is untouched
    assert rest.get(f"{collection('Pod', namespace)}/workload")["status"]["phase"] == "Running"

    # Exclusivity for ordinary claims is as before: the whole GPU waits while its MIG device is held.
    run(rest, node, namespace, _claim("whole", GPU_CLASS, by_uuid(gpu0), admin_access=False))
    wait_unschedulable(rest, namespace, "whole")


@pytest.mark.parametrize("kind", ["ResourceClaim", "ResourceClaimTemplate"])
def test_a_request_without_admin_access_cannot_use_the_maintenance_class(
    rest: RestClient, admin_namespace: str, kind: str
) -> None:
    claim = _claim("sneaky", MAINTENANCE_CLASS, None, admin_access=False)
    obj = claim if kind == "ResourceClaim" else {**claim, "kind": kind, "spec": {"spec": claim["spec"]}}

    with pytest.raises(ApiError) as refused:
        rest.create(collection(kind, admin_namespace), obj)

    assert refused.value.status == 403
    assert (
        f"device class {MAINTENANCE_CLASS} holds the GPUs' maintenance devices, for admin access only: "
        in (refused.value.message)
    )
    assert "request gpu must set adminAccess: true" in refused.value.message


def test_a_first_available_alternative_cannot_use_the_maintenance_class(
    rest: RestClient, admin_namespace: str
) -> None:
    claim = _claim("fallback", GPU_CLASS, None, admin_access=False)
    claim["spec"]["devices"]["requests"] = [
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "whole", "deviceClassName": GPU_CLASS},
                {"name": "maint", "deviceClassName": MAINTENANCE_CLASS},
            ],
        }
    ]
    with pytest.raises(ApiError) as refused:
        rest.create(collection("ResourceClaim", admin_namespace), claim)
    assert refused.value.status == 403
    assert "which a firstAvailable alternative cannot request" in refused.value.message
