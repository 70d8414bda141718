"""In-node topology through the real scheduler: docs/examples/topology/ on a simulated PCIe server
(8x H100 NVL, NVLink bridges between GPUs 0-1, 2-3, 4-5, 6-7, four GPUs behind one PCIe switch per
CPU socket), beside a second DRA driver of the suite's own that publishes fake NICs
(e2e/nic_driver.py).

What is checked is the hardware the scheduler handed out, read from the simulator (the far ends of
each GPU's NVLinks, its PCIe root, switch and NUMA node), not the attributes it chose by.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dra_driver.devices.types import Gpu, Inventory
from dra_driver.resources.device_names import gpu_device_name
from e2e import manifests
from e2e.claims import gpu_uuid, run_on_gpu, wait_unschedulable
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import Daemon, wait_until
from e2e.gpu_node import GpuNode
from e2e.manifests import collection
from e2e.nic_driver import RUNNING
from e2e.workloads import delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.e2e

TOPOLOGY = manifests.EXAMPLES / "topology"
NIC_DRIVER = "nic.example.com"  # the NIC DeviceClass docs/examples/topology/gpu-and-nic.yaml names
PROFILE = "pcie-h100nvl-bridged"
NO_GPU_ROOT = "pci0000:5c"  # a root complex of the server with no GPU behind it


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """This module's node: the PCIe server with bridged pairs (replaces conftest's DGX H100)."""
    name = "node-topology"
    node = GpuNode(cluster, kubelet_harness_binary, tmp_path_factory.mktemp(name), name, profile=PROFILE)
    with node.running():
        yield node


@pytest.fixture(scope="module")
def nics(cluster: ClusterInfo, gpu_node: GpuNode) -> Iterator[dict[str, str]]:
    """The fake NIC driver on the node, its DeviceClass installed; the NICs' PCIe roots by name.

    The first NIC sits on a root without GPUs and the others in the reverse order of the GPUs'
    roots, so the first NIC and the first GPU a naive allocator would take are never a pair.
    """
    rest = cluster.rest()
    roots = sorted({gpu.pcie_root or "" for gpu in gpu_node.driver.simulated_gpus().gpus}, reverse=True)
    table = {f"nic-{i}": root for i, root in enumerate([NO_GPU_ROOT, *roots])}
    device_class = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": NIC_DRIVER},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{NIC_DRIVER}"'}}]},
    }
    rest.create(collection("DeviceClass"), device_class)
    base = gpu_node.harness.registry_dir.parent
    daemon = Daemon(f"nic-driver[{gpu_node.name}]", base / "nic-driver.log")
    argv = [
        sys.executable,
        str(Path(__file__).with_name("nic_driver.py")),
        f"--kubeconfig={cluster.kubeconfig}",
        f"--node-name={gpu_node.name}",
        f"--driver={NIC_DRIVER}",
        f"--registry-dir={gpu_node.harness.registry_dir}",
        f"--plugins-dir={base / 'nic-plugins'}",
        *(f"--nic={name}={root}" for name, root in table.items()),
    ]
    daemon.start(argv, lambda offset: RUNNING in daemon.log_since(offset), timeout_seconds=60)
    try:
        yield table
    finally:
        daemon.stop()
        rest.delete(f"{collection('DeviceClass')}/{NIC_DRIVER}")
        rest.request("DELETE", "/apis/resource.k8s.io/v1/resourceslices", query={
            "fieldSelector": f"spec.nodeName={gpu_node.name},spec.driver={NIC_DRIVER}"
        })  # fmt: skip


@pytest.fixture(autouse=True)
def devices_free(rest: RestClient, gpu_node: GpuNode) -> None:
    """Each test starts with every device of the node free in the scheduler's eyes.

    The claims of the test before go with its namespace, a moment after its pods: a pod the
    scheduler finds no room for meanwhile waits for the scheduler's next retry, not for them.
    """

    def free() -> bool:
        claims = rest.get("/apis/resource.k8s.io/v1/resourceclaims")["items"]
        return not any(
            result["pool"] == gpu_node.name
            for claim in claims
            for result in ((claim.get("status") or {}).get("allocation") or {})
            .get("devices", {})
            .get("results", [])
        )

    wait_until(
        free, timeout_seconds=120, waiting_for=f"the claims of the test before to leave {gpu_node.name}"
    )


def gpu_of(inventory: Inventory, device: str) -> Gpu:
    (gpu,) = [gpu for gpu in inventory.gpus if gpu_device_name(gpu.minor) == device]
    return gpu


def allocation(claim: JsonObject) -> list[tuple[str, str]]:
    """(driver, device) of every device the scheduler allocated to the claim."""
    return [(r["driver"], r["device"]) for r in claim["status"]["allocation"]["devices"]["results"]]


def example_template(rest: RestClient, example: str, namespace: str) -> JsonObject:
    """Creates the example's claim template; returns the example's pod, for `start_copy`."""
    template, pod = manifests.load(TOPOLOGY / example)
    manifests.apply(rest, [template], namespace)
    return pod


def start_copy(rest: RestClient, pod: JsonObject, index: int, namespace: str, node: GpuNode) -> str:
    """A copy of the example's pod, named `<name>-<index>`, with a claim of its own from the template,
    as one more user applying the example would; returns its name."""
    copy_of_pod = copy.deepcopy(pod)
    copy_of_pod["metadata"]["name"] = f"{pod['metadata']['name']}-{index}"
    manifests.apply(rest, manifests.pinned([copy_of_pod], node.name), namespace)
    return str(copy_of_pod["metadata"]["name"])


def claim_of_pod(rest: RestClient, namespace: str, name: str) -> JsonObject:
    pod = wait_running(rest, namespace, name)
    return pod_claim(rest, pod, pod["spec"]["resourceClaims"][0]["name"])


def bridged(a: Gpu, b: Gpu) -> bool:
    return b.pci_bus_id in a.nvlink_remotes and a.pci_bus_id in b.nvlink_remotes


def test_two_nvlinked_gpus_are_a_bridged_pair_every_time(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    hardware = node.driver.simulated_gpus()
    # GPU 0 is taken first: its partner GPU 1 is then free but has no free partner of its own.
    run_on_gpu(rest, node, namespace, "holder", gpu_uuid(node, 0))
    wait_running(rest, namespace, "holder")

    pod = example_template(rest, "nvlink-pair.yaml", namespace)
    taken = []
    for index in range(3):  # one after another: which claim gets which pair is then the test's to say
        name = start_copy(rest, pod, index, namespace, node)
        claim = claim_of_pod(rest, namespace, name)
        a, b = (gpu_of(hardware, device) for _, device in allocation(claim))
        assert bridged(a, b), f"{name} got GPUs {a.minor} and {b.minor}, which no NVLink bridge joins"
        taken.append(sorted((a.minor, b.minor)))
    assert sorted(taken) == [[2, 3], [4, 5], [6, 7]]
    # GPU 1 alone is left: no pair for a fourth claim.
    last = start_copy(rest, pod, 3, namespace, node)
    wait_unschedulable(rest, namespace, last)

    delete_pod(rest, namespace, "holder")
    rest.delete(f"{collection('ResourceClaim', namespace)}/holder")
    claim = claim_of_pod(rest, namespace, last)
    assert sorted(gpu_of(hardware, device).minor for _, device in allocation(claim)) == [0, 1]


def test_a_gpu_and_a_nic_land_on_one_pcie_root(
    rest: RestClient, node: GpuNode, namespace: str, nics: dict[str, str]
) -> None:
    hardware = node.driver.simulated_gpus()
    pod = example_template(rest, "gpu-and-nic.yaml", namespace)
    used_nics = set()
    for index in range(2):
        name = start_copy(rest, pod, index, namespace, node)
        claim = claim_of_pod(rest, namespace, name)
        devices = dict(allocation(claim))
        gpu, nic = gpu_of(hardware, devices[node.driver_name]), devices[NIC_DRIVER]
        assert gpu.pcie_root == nics[nic], f"{name}: GPU {gpu.minor} on {gpu.pcie_root}, {nic} on {nics[nic]}"
        used_nics.add(nic)
    assert len(used_nics) == 2
    # The NIC left sits on a root without GPUs: a third pair cannot be made.
    wait_unschedulable(rest, namespace, start_copy(rest, pod, 2, namespace, node))


@pytest.mark.parametrize(
    ("example", "place"),
    [("same-pcie-switch.yaml", "pcie_switch"), ("same-socket.yaml", "numa_node")],
)
def test_two_gpus_share_a_pcie_switch_or_a_socket(
    rest: RestClient, node: GpuNode, namespace: str, example: str, place: str
) -> None:
    hardware = node.driver.simulated_gpus()
    # GPUs 0-2 are taken first: the one GPU left behind the first switch (and socket) has no partner.
    for minor in range(3):
        run_on_gpu(rest, node, namespace, f"holder-{minor}", gpu_uuid(node, minor))
    name = start_copy(rest, example_template(rest, example, namespace), 0, namespace, node)
    claim = claim_of_pod(rest, namespace, name)
    a, b = (gpu_of(hardware, device) for _, device in allocation(claim))
    assert getattr(a, place) is not None
    assert getattr(a, place) == getattr(b, place), f"GPUs {a.minor} and {b.minor}"
    assert {a.minor, b.minor} <= {4, 5, 6, 7}
