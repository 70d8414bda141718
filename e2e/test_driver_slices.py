"""The driver's ResourceSlices against the real API server and scheduler (no driver process): what the
daemon would publish for every simulated node passes API validation, and the scheduler satisfies CEL
selectors on the driver's attributes and capacities with exactly the right devices.

The slices come from the same pure functions the daemon and `dra-driver inventory` use, and are
written as the daemon writes them: server-side apply, one request per slice.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dra_driver.gpu_plugin.policies import desired_slices
from dra_driver.resources.pool import PoolOwner, dropped_fields, plan_pool
from dra_driver.resources.server_rules import rules_for
from dra_driver.resources.wire import ResourceSlice
from dra_driver.settings import Settings
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.nodes import NODE_PROFILES
from e2e import manifests
from e2e.claims import claim_and_pod
from e2e.cluster import ClusterInfo, FakeNodeFactory, JsonObject, RestClient
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import SLICES, node_slices_query, published_devices
from e2e.manifests import collection

pytestmark = pytest.mark.cluster

_ATTRIBUTES = f'device.attributes["{DRIVER_NAME}"]'
_CAPACITY = f'device.capacity["{DRIVER_NAME}"]'


def pool_slices(
    profile: str, node_name: str, mig_partitions: str, data_dir: Path, kube_version: str
) -> list[ResourceSlice]:
    """What the daemon would publish for a fresh simulated node to an API server of `kube_version`
    (the slice layout differs on 1.34, see dra_driver.resources.server_rules)."""
    backend = SimulatedBackend(profile, node_name, data_dir)
    try:
        inventory = backend.inventory()
    finally:
        backend.close()
    settings = Settings(node_name=node_name, mig_partitions=mig_partitions)
    owner = PoolOwner(driver=settings.driver_name, node_name=node_name)
    rules = rules_for(kube_version)
    return list(plan_pool(desired_slices(settings, inventory, rules=rules), [], owner=owner).apply)


def apply_slice(rest: RestClient, manifest: ResourceSlice) -> JsonObject:
    return rest.request(
        "PATCH",
        f"{SLICES}/{manifest['metadata']['name']}",
        dict(manifest),
        query={"fieldManager": DRIVER_NAME, "force": "true"},
        content_type="application/apply-patch+yaml",  # JSON is YAML
    )


def delete_pool(rest: RestClient, node_name: str) -> None:
    rest.request("DELETE", SLICES, query=node_slices_query(node_name))


@pytest.mark.parametrize("mig_partitions", ["none", "all"])
@pytest.mark.parametrize("profile", sorted(NODE_PROFILES))
def test_every_simulated_node_publishes_slices_the_api_server_stores_unchanged(
    rest: RestClient, cluster: ClusterInfo, tmp_path: Path, profile: str, mig_partitions: str
) -> None:
    check_slices_stored_unchanged(rest, cluster, tmp_path, profile, mig_partitions)


@pytest.mark.kube_versions
def test_a_partitioned_dgx_h100_publishes_slices_the_api_server_stores_unchanged(
    rest: RestClient, cluster: ClusterInfo, tmp_path: Path
) -> None:
    """The CI-sized check of every release: MIG counters (whose layout differs on 1.34) and taints."""
    check_slices_stored_unchanged(rest, cluster, tmp_path, "dgx-h100", "all")


def check_slices_stored_unchanged(
    rest: RestClient, cluster: ClusterInfo, tmp_path: Path, profile: str, mig_partitions: str
) -> None:
    node_name = f"accept-{profile}-mig-{mig_partitions}"
    slices = pool_slices(profile, node_name, mig_partitions, tmp_path, cluster.kube_version)
    try:
        for manifest in slices:
            stored = apply_slice(rest, manifest)
            # A server drops fields of disabled features silently; counters and taints must survive.
            assert dropped_fields(manifest["spec"], stored["spec"]) == []
        sent = {device["name"] for manifest in slices for device in manifest["spec"].get("devices", [])}
        assert published_devices(rest, node_name).keys() == sent
    finally:
        delete_pool(rest, node_name)


# --- the scheduler, on a simulated "mixed" node: 2x H100 80GB, 2x A100-SXM4-40GB, 2x L4 ----------------

MixedNode = tuple[str, dict[str, JsonObject]]  # node name, published devices by name


@pytest.fixture
def mixed_node(
    rest: RestClient,
    cluster: ClusterInfo,
    fake_node: FakeNodeFactory,
    gpu_device_class: str,
    tmp_path: Path,
) -> Iterator[MixedNode]:
    """A node without a kubelet whose pool the tests publish by hand (MIG partitions on)."""
    name = f"mixed-{uuid.uuid4().hex[:8]}"
    fake_node(name)
    for manifest in pool_slices("mixed", name, "all", tmp_path, cluster.kube_version):
        apply_slice(rest, manifest)
    try:
        yield name, published_devices(rest, name)
    finally:
        delete_pool(rest, name)


def allocated_device(rest: RestClient, namespace: str, claim: str, node_name: str) -> str:
    allocated = rest.wait_for(
        collection("ResourceClaim", namespace),
        claim,
        lambda c: bool(c.get("status", {}).get("allocation")),
        timeout_seconds=60,
    )
    (result,) = allocated["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER_NAME, node_name)
    device: str = result["device"]
    return device


def allocation(rest: RestClient, namespace: str, claim: str) -> JsonObject | None:
    stored = rest.get(f"{collection('ResourceClaim', namespace)}/{claim}")
    result: JsonObject | None = stored.get("status", {}).get("allocation")
    return result


def wait_unschedulable(rest: RestClient, namespace: str, pod: str) -> JsonObject:
    def unschedulable(item: JsonObject) -> bool:
        conditions = item.get("status", {}).get("conditions") or []
        return any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conditions)

    return rest.wait_for(collection("Pod", namespace), pod, unschedulable, timeout_seconds=60)


Devices = dict[str, JsonObject]


def _attribute(devices: Devices, device: str, name: str) -> str:
    value: str = devices[device]["attributes"][name]["string"]
    return value


# (expression from the published devices, the devices that may satisfy it)
SELECTORS: dict[str, tuple[Callable[[Devices], str], set[str]]] = {
    "product-name": (lambda _: f'{_ATTRIBUTES}.productName == "NVIDIA A100-SXM4-40GB"', {"gpu-2", "gpu-3"}),
    "architecture": (lambda _: f'{_ATTRIBUTES}.architecture == "Ada Lovelace"', {"gpu-4", "gpu-5"}),
    "uuid": (lambda d: f'{_ATTRIBUTES}.uuid == "{_attribute(d, "gpu-1", "uuid")}"', {"gpu-1"}),
    "pci-bus-id": (
        lambda d: (
            f'device.attributes["resource.kubernetes.io"].pciBusID == '
            f'"{_attribute(d, "gpu-3", "resource.kubernetes.io/pciBusID")}"'
        ),
        {"gpu-3"},
    ),
    "pci-device-id": (lambda _: f'{_ATTRIBUTES}.pciDeviceID == "0x27b8"', {"gpu-4", "gpu-5"}),
    "compute-capability-above-8.0": (
        lambda _: f'{_ATTRIBUTES}.cudaComputeCapability.isGreaterThan(semver("8.0.0"))',
        {"gpu-0", "gpu-1", "gpu-4", "gpu-5"},
    ),
    "compute-capability-and-small-memory": (
        lambda _: (
            f'{_ATTRIBUTES}.cudaComputeCapability.isGreaterThan(semver("8.0.0")) && '
            f'{_CAPACITY}.memory.compareTo(quantity("30Gi")) < 0'
        ),
        {"gpu-4", "gpu-5"},
    ),
    "memory-at-least-80G": (
        lambda _: f'{_CAPACITY}.memory.compareTo(quantity("80G")) >= 0',
        {"gpu-0", "gpu-1"},
    ),
    "multiprocessors-at-least-100": (
        lambda _: f'{_CAPACITY}.multiprocessors.compareTo(quantity("100")) >= 0',
        {"gpu-0", "gpu-1", "gpu-2", "gpu-3"},
    ),
    "driver-version": (
        lambda _: (
            f'{_ATTRIBUTES}.driverVersion.isGreaterThan(semver("580.95.4")) && '
            f'{_ATTRIBUTES}.cudaDriverVersion == semver("13.0.0") && {_ATTRIBUTES}.vendor == "NVIDIA"'
        ),
        {f"gpu-{minor}" for minor in range(6)},
    ),
}


@pytest.mark.parametrize("selector", SELECTORS)
def test_scheduler_allocates_a_device_that_satisfies_the_selector(
    rest: RestClient, namespace: str, mixed_node: MixedNode, gpu_device_class: str, selector: str
) -> None:
    node_name, devices = mixed_node
    expression, satisfying = SELECTORS[selector]
    manifests.apply(rest, claim_and_pod("gpu", gpu_device_class, expression(devices), node_name), namespace)

    assert allocated_device(rest, namespace, "gpu", node_name) in satisfying


@pytest.mark.kube_versions
def test_documented_h100_selector_gets_an_h100(
    rest: RestClient, namespace: str, mixed_node: MixedNode
) -> None:
    node_name, _ = mixed_node
    manifests.apply_example(rest, manifests.DEMO / "h100-by-selector.yaml", namespace, node_name=node_name)

    pod = rest.wait_for(collection("Pod", namespace), "h100", lambda p: bool(p["spec"].get("nodeName")))
    (status,) = pod["status"]["resourceClaimStatuses"]
    assert allocated_device(rest, namespace, status["resourceClaimName"], node_name) in {"gpu-0", "gpu-1"}


def test_a_selector_that_nothing_satisfies_leaves_the_claim_unallocated_and_the_pod_unscheduled(
    rest: RestClient, namespace: str, mixed_node: MixedNode, gpu_device_class: str
) -> None:
    node_name, _ = mixed_node
    expression = f'{_ATTRIBUTES}.productName.startsWith("NVIDIA B200")'
    manifests.apply(rest, claim_and_pod("b200", gpu_device_class, expression, node_name), namespace)

    pod = wait_unschedulable(rest, namespace, "b200")
    assert not pod["spec"].get("nodeName")
    assert not allocation(rest, namespace, "b200")


@pytest.mark.kube_versions
def test_a_gpu_in_use_whole_offers_no_mig_partition_while_another_gpu_does(
    rest: RestClient, namespace: str, mixed_node: MixedNode, gpu_device_class: str, mig_device_class: str
) -> None:
    node_name, devices = mixed_node
    first, second = (_attribute(devices, gpu, "uuid") for gpu in ("gpu-0", "gpu-1"))
    whole = claim_and_pod("whole", gpu_device_class, f'{_ATTRIBUTES}.uuid == "{first}"', node_name)
    manifests.apply(rest, whole, namespace)
    assert allocated_device(rest, namespace, "whole", node_name) == "gpu-0"

    for name, parent in (("mig-on-used-gpu", first), ("mig-on-free-gpu", second)):
        expression = f'{_ATTRIBUTES}.parentUUID == "{parent}" && {_ATTRIBUTES}.profile == "1g.10gb"'
        manifests.apply(rest, claim_and_pod(name, mig_device_class, expression, node_name), namespace)

    assert allocated_device(rest, namespace, "mig-on-free-gpu", node_name).startswith("gpu-1-mig-1g10gb-")
    # The whole GPU consumes all of its counters: none of its MIG placements fits any more.
    wait_unschedulable(rest, namespace, "mig-on-used-gpu")
    assert not allocation(rest, namespace, "mig-on-used-gpu")
