"""GPU health end to end: faults injected into a simulated DGX H100 (the documented `dra-driver simulate`
command) become taints in the node's ResourceSlices, which the real scheduler and the real controller
manager act on, and device health in the pod status, as the kubelet's own DRA manager reports it.

The node's API traffic -- driver and kubelet harness alike -- passes through a relay the tests can cut,
to see what an API outage does while the driver taints a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from dra_driver.simulated.gpus import SimulatedBackend
from e2e.claims import claim_of, gpu_uuid, run_on_gpu, wait_unschedulable
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.cluster.features import kube_minor
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode, published_devices
from e2e.manifests import collection
from e2e.workloads import (
    allocated_devices,
    delete_pod,
    expected_cdi_ids,
    pod_claim,
    pod_path,
    wait_gone,
    wait_running,
)

pytestmark = pytest.mark.e2e

XID_KEY = f"{DRIVER_NAME}/xid"
TIMEOUT_S = 60.0


# --- a relay in front of the API server ----------------------------------------------------------


class ApiRelay:
    """Relays TCP connections to the API server; `cut()` drops them all and refuses new ones."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="api-relay", daemon=True).start()

    def cut(self) -> None:
        self._up.clear()
        with self._lock:
            for conn in self._open:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open |= {client, server}
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(a, selectors.EVENT_READ, b)
            selector.register(b, selectors.EVENT_READ, a)
            try:
                while True:
                    for key, _ in selector.select():
                        data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                        if not data:
                            return
                        key.data.sendall(data)
            except OSError:
                return
            finally:
                with self._lock:
                    self._open -= {a, b}
                a.close()
                b.close()


@pytest.fixture(scope="module")
def relay(cluster: ClusterInfo) -> Iterator[ApiRelay]:
    relay = ApiRelay(("127.0.0.1", int(cluster.server.rpartition(":")[2])))
    yield relay
    relay.close()


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    relay: ApiRelay,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """The module's node (as in conftest.py), its kubelet and driver reaching the API server through
    the relay."""
    base_dir = tmp_path_factory.mktemp("node-health")
    kubeconfig = yaml.safe_load(cluster.kubeconfig.read_text())
    kubeconfig["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    relayed = base_dir / "kubeconfig"
    relayed.write_text(yaml.safe_dump(kubeconfig))
    node = GpuNode(
        dataclasses.replace(cluster, kubeconfig=relayed),
        kubelet_harness_binary,
        base_dir,
        "node-health",
        driver_args=["--mig-partitions=all"],
    )
    with node.running():
        yield node


@pytest.fixture(autouse=True)
def healthy_again(node: GpuNode, rest: RestClient, relay: ApiRelay) -> Iterator[None]:
    """Every test leaves the node's GPUs healthy and untainted for the next one."""
    yield
    relay.restore()
    backend = SimulatedBackend(node.driver.profile, node.name, node.driver.paths.data)
    for index in range(len(backend.inventory().gpus)):
        backend.recover(index)
    wait_until(
        lambda: not any(d.get("taints") for d in published_devices(rest, node.name).values()),
        timeout_seconds=TIMEOUT_S,
        waiting_for="every taint on the node to go",
    )


# --- helpers -------------------------------------------------------------------------------------


def simulate(node: GpuNode, *args: str) -> subprocess.CompletedProcess[str]:
    """`dra-driver simulate ...` for the node, as the documentation shows it."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "dra_driver",
            "simulate",
            *args,
            f"--simulate={node.driver.profile}",
            f"--node-name={node.name}",
            f"--data-dir={node.driver.paths.data}",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=TIMEOUT_S,
    )


def devices_of_gpu(rest: RestClient, node: GpuNode, minor: int) -> dict[str, JsonObject]:
    """The published devices made of GPU `minor`: itself and its MIG placements."""
    name = f"gpu-{minor}"
    return {
        device: item
        for device, item in published_devices(rest, node.name).items()
        if device == name or device.startswith(f"{name}-mig-")
    }


def wait_taints(
    rest: RestClient, node: GpuNode, minor: int, expected: set[tuple[str, str | None, str]]
) -> None:
    """Until every device of GPU `minor` carries exactly the taints (key, value, effect) `expected`."""

    def tainted_as_expected() -> bool:
        devices = devices_of_gpu(rest, node, minor)
        return bool(devices) and all(
            {(t["key"], t.get("value"), t["effect"]) for t in d.get("taints", [])} == expected
            for d in devices.values()
        )

    wait_until(tainted_as_expected, timeout_seconds=TIMEOUT_S, waiting_for=f"gpu-{minor} tainted {expected}")


def device_health(pod: JsonObject) -> dict[str, str]:
    """resourceID (a CDI device id) -> health, from the pod's containerStatuses[].allocatedResourcesStatus."""
    return {
        resource["resourceID"]: resource["health"]
        for status in pod.get("status", {}).get("containerStatuses") or []
        for entry in status.get("allocatedResourcesStatus") or []
        for resource in entry.get("resources") or []
    }


def slice_writes(node: GpuNode, since: int) -> int:
    """ResourceSlice writes the driver logged since log offset `since`."""
    log = node.driver.daemon.log_since(since)
    return sum(int(n) for n in re.findall(r"resourceslices published.*?written=(\d+)", log))


# --- the tests -----------------------------------------------------------------------------------


@pytest.mark.kube_versions
def test_an_xid_taints_the_gpu_and_its_partitions_and_only_tolerating_claims_get_it_until_it_recovers(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    uuid = gpu_uuid(node, 3)
    injected = simulate(node, "xid", "--gpu", "3", "--xid", "48")
    assert injected.returncode == 0, injected.stderr

    wait_taints(rest, node, 3, {(XID_KEY, "48", "NoSchedule")})
    assert len(devices_of_gpu(rest, node, 3)) == 26  # the GPU and its 25 MIG placements
    assert not any(
        d.get("taints")
        for name, d in published_devices(rest, node.name).items()
        if not name.startswith("gpu-3")
    )

    run_on_gpu(rest, node, namespace, "waits", uuid)
    pending = wait_unschedulable(rest, namespace, "waits")
    assert pending["status"]["phase"] == "Pending"
    assert not claim_of(rest, namespace, "waits").get("status", {}).get("allocation")

    toleration = {"key": XID_KEY, "operator": "Exists", "effect": "NoSchedule"}
    run_on_gpu(rest, node, namespace, "tolerates", uuid, [toleration])
    tolerant = wait_running(rest, namespace, "tolerates")
    assert allocated_devices(pod_claim(rest, tolerant, "gpu")) == ["gpu-3"]
    delete_pod(rest, namespace, "tolerates")

    recovered = simulate(node, "recover", "--gpu", "3")
    assert recovered.returncode == 0, recovered.stderr
    wait_taints(rest, node, 3, set())
    waited = wait_running(rest, namespace, "waits")
    assert allocated_devices(pod_claim(rest, waited, "gpu")) == ["gpu-3"]


def kubelet_reports_health_of_named_claims(kube_version: str) -> bool:
    """Whether the kubelet puts device health into the status of a pod that names its ResourceClaim
    (resourceClaimName), as run_on_gpu's pods do. Before 1.36 it finds such a claim only when the
    pod's claim entry has the claim's own name (1.34) or through pod.status.resourceClaimStatuses,
    which only template-made claims get (1.35); 1.36 also resolves it from the pod's spec."""
    return kube_minor(kube_version) >= 36


def test_device_health_reaches_the_pod_status_and_the_claim_status_names_the_gpu(
    rest: RestClient, cluster: ClusterInfo, node: GpuNode, namespace: str
) -> None:
    uuid = gpu_uuid(node, 2)
    run_on_gpu(rest, node, namespace, "app", uuid)
    pod = wait_running(rest, namespace, "app")
    # The kubelet names each device of the container by the CDI id the driver gave it.
    (resource,) = expected_cdi_ids(pod_claim(rest, pod, "gpu"))
    pods = collection("Pod", namespace)
    in_pod_status = kubelet_reports_health_of_named_claims(cluster.kube_version)
    if in_pod_status:
        rest.wait_for(pods, "app", lambda pod: device_health(pod).get(resource) == "Healthy")

    def status_device(claim: JsonObject) -> JsonObject | None:
        entries = claim.get("status", {}).get("devices") or []
        return next((e for e in entries if e["driver"] == DRIVER_NAME), None)

    claims = collection("ResourceClaim", namespace)
    claim = rest.wait_for(claims, "app", lambda c: status_device(c) is not None)
    entry = status_device(claim)
    assert entry is not None
    assert (entry["pool"], entry["device"], entry["data"]) == (node.name, "gpu-2", {"uuid": uuid})
    assert [(c["type"], c["status"]) for c in entry["conditions"]] == [("Healthy", "True")]
    labels = {"namespace": namespace, "claim": "app", "device": "gpu-2", "uuid": uuid}
    uid = claim["metadata"]["uid"]
    wait_until(  # the metric follows the status write a moment later
        lambda: node.driver.metric("dra_driver_claim_device_info", **labels, claim_uid=uid, healthy="True"),
        timeout_seconds=TIMEOUT_S,
        waiting_for="the metric to show the device healthy",
    )

    assert simulate(node, "xid", "--gpu", "2", "--xid", "94").returncode == 0
    if in_pod_status:
        rest.wait_for(pods, "app", lambda pod: device_health(pod).get(resource) == "Unhealthy")
    unhealthy = rest.wait_for(
        claims, "app", lambda c: (status_device(c) or {}).get("conditions", [{}])[0].get("status") == "False"
    )
    (condition,) = status_device(unhealthy)["conditions"]  # type: ignore[index]
    assert (condition["reason"], condition["message"].split(" since ")[0]) == (
        "XidError",
        "Xid 94 (contained ECC error)",
    )
    wait_until(
        lambda: node.driver.metric("dra_driver_claim_device_info", **labels, claim_uid=uid, healthy="False"),
        timeout_seconds=TIMEOUT_S,
        waiting_for="the metric to show the device unhealthy",
    )

    assert simulate(node, "recover", "--gpu", "2").returncode == 0
    if in_pod_status:
        rest.wait_for(pods, "app", lambda pod: device_health(pod).get(resource) == "Healthy")
    else:  # the claim's status shows the recovery all the same
        rest.wait_for(
            claims,
            "app",
            lambda c: (status_device(c) or {}).get("conditions", [{}])[0].get("status") == "True",
        )


def test_a_gpu_that_fell_off_the_bus_evicts_its_pods_and_their_claims_are_unprepared(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    run_on_gpu(rest, node, namespace, "doomed", gpu_uuid(node, 5))
    pod = wait_running(rest, namespace, "doomed")
    claim_uid = pod_claim(rest, pod, "gpu")["metadata"]["uid"]
    assert node.driver.spec_path(claim_uid).exists()

    assert simulate(node, "xid", "--gpu", "5", "--xid", "79").returncode == 0

    wait_taints(rest, node, 5, {(XID_KEY, "79", "NoExecute")})
    wait_gone(rest, pod_path(namespace, "doomed"))  # evicted by kube-controller-manager
    wait_until(
        lambda: not node.driver.spec_path(claim_uid).exists(),
        timeout_seconds=TIMEOUT_S,
        waiting_for="the evicted pod's claim to be unprepared",
    )
    assert node.driver.metric("dra_driver_claim_operations", operation="unprepare", result="error") == 0


def test_an_event_for_a_gpu_the_node_does_not_have_is_refused_and_changes_nothing(
    rest: RestClient, node: GpuNode
) -> None:
    refused = simulate(node, "xid", "--gpu", "42", "--xid", "79")
    assert refused.returncode == 1
    assert "no GPU with index 42; node node-health has 0..7" in refused.stderr
    unknown_uuid = simulate(node, "xid", "--gpu", "GPU-00000000-0000-0000-0000-000000000000", "--xid", "79")
    assert unknown_uuid.returncode == 1
    assert (
        "no GPU GPU-00000000-0000-0000-0000-000000000000 on simulated node node-health" in unknown_uuid.stderr
    )
    assert not any(d.get("taints") for d in published_devices(rest, node.name).values())
    assert node.driver.readiness()[0] == 200


def test_a_flood_of_xids_costs_a_few_slice_writes_and_ends_in_the_right_taints(
    rest: RestClient, node: GpuNode
) -> None:
    backend = SimulatedBackend(node.driver.profile, node.name, node.driver.paths.data)
    offset = node.driver.daemon.log_size()
    flood = [48, 94, 95, 13, 31] * 100  # 500 events, two of the Xids ignored as application errors
    for number in flood:
        backend.inject_xid(6, number)

    wait_taints(rest, node, 6, {(XID_KEY, str(n), "NoSchedule") for n in (48, 94, 95)})
    writes = slice_writes(node, offset)
    assert 0 < writes < 50, f"{writes} ResourceSlice writes for {len(flood)} events"


def test_taints_set_during_an_api_outage_are_published_once_it_ends(
    rest: RestClient, node: GpuNode, relay: ApiRelay
) -> None:
    offset = node.driver.daemon.log_size()
    relay.cut()
    assert simulate(node, "xid", "--gpu", "1", "--xid", "48").returncode == 0
    wait_until(
        lambda: "resourceslice sync failed" in node.driver.daemon.log_since(offset),
        timeout_seconds=TIMEOUT_S,
        waiting_for="the driver to fail publishing while the API server is unreachable",
    )
    assert (
        simulate(node, "xid", "--gpu", "1", "--xid", "79").returncode == 0
    )  # a second change, still cut off
    assert not devices_of_gpu(rest, node, 1)["gpu-1"].get("taints")

    relay.restore()

    wait_taints(rest, node, 1, {(XID_KEY, "48", "NoSchedule"), (XID_KEY, "79", "NoExecute")})
    assert node.driver.daemon.running
