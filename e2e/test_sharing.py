"""GPU sharing end to end: the time-slicing and MPS examples applied to the real control plane, prepared
on a simulated DGX H100 by the kubelet's own DRA code, checked on the GPU (its compute mode and time
slice, as the simulator holds them), on the node (the MPS daemon, a stand-in process there: docs/sharing.md)
and in what the containers get (the CDI spec)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from dra_driver.devices.types import ComputeMode, ComputePolicy, TimeSlice
from dra_driver.simulated.gpus import SimulatedBackend
from dra_driver.simulated.mps_daemons import LocalMpsDaemons
from e2e import manifests
from e2e.cluster import JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.gpu_node import GpuNode
from e2e.workloads import allocated_devices, check_cdi_spec, delete_pod, pod_claim, wait_running

pytestmark = pytest.mark.e2e


def gpus(node: GpuNode) -> SimulatedBackend:
    """The node's simulated GPUs, as `nvidia-smi` would show them."""
    driver = node.driver
    return SimulatedBackend(driver.profile, driver.node_name, driver.paths.data)


def daemons(node: GpuNode) -> LocalMpsDaemons:
    return LocalMpsDaemons(node.driver.paths.data / "mps")


def policy_of(node: GpuNode, device: str) -> ComputePolicy:
    backend = gpus(node)
    (gpu,) = [g for g in backend.inventory().gpus if f"gpu-{g.minor}" == device]
    return backend.compute_policy(gpu.uuid)


def claim_of(rest: RestClient, namespace: str, pod: str) -> JsonObject:
    return pod_claim(rest, wait_running(rest, namespace, pod), "gpu")


@pytest.fixture(autouse=True)
def no_daemon_outlives_a_test(node: GpuNode) -> Iterator[None]:
    """Stand-in daemons run in sessions of their own: one a failed test left behind is ended here."""
    yield
    daemons(node).stop_all()


@pytest.fixture
def mps_fault(node: GpuNode) -> Iterator[SimulatedBackend]:
    """Every GPU of the node refuses to run an MPS server until the test repairs it."""
    backend = gpus(node)
    count = len(backend.inventory().gpus)
    for index in range(count):
        backend.set_mps_broken(index, True)
    yield backend
    for index in range(count):
        backend.set_mps_broken(index, False)


def test_time_slicing_sets_the_gpu_while_the_claim_is_prepared_and_restores_it(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "time-sliced-gpu.yaml", namespace, node_name=node.name)

    claim = claim_of(rest, namespace, "time-sliced")
    (device,) = allocated_devices(claim)
    assert policy_of(node, device) == ComputePolicy(ComputeMode.DEFAULT, TimeSlice.LONG)

    delete_pod(rest, namespace, "time-sliced")
    assert policy_of(node, device) == ComputePolicy()


def test_mps_runs_the_claims_daemon_and_stops_it_with_the_claim(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "mps-gpu.yaml", namespace, node_name=node.name)

    claim = claim_of(rest, namespace, "mps")
    uid = claim["metadata"]["uid"]
    (device,) = allocated_devices(claim)
    assert policy_of(node, device).compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    (daemon,) = [d for d in (node.driver.paths.data / "mps").iterdir() if d.name.startswith(f"{uid}-")]
    pid = daemons(node).pid(daemon.name)
    assert pid is not None, (daemon / "log" / "control.log").read_text()
    assert (daemon / "log" / "startup.log").read_text() == "startup complete\n"

    spec = check_cdi_spec(node, claim)
    env = dict(variable.split("=", 1) for variable in spec["containerEdits"]["env"])
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=10240M")
    mounts = {m["containerPath"]: m["hostPath"] for m in spec["containerEdits"]["mounts"]}
    assert mounts["/tmp/nvidia-mps"] == str(daemon / "pipe")
    assert mounts["/dev/shm"] == str(daemon / "shm")

    delete_pod(rest, namespace, "mps")
    assert not daemon.exists()
    assert daemons(node).pid(daemon.name) is None
    assert policy_of(node, device) == ComputePolicy()


def test_a_daemon_that_fails_keeps_the_pod_pending_with_the_reason_and_leaves_nothing(
    rest: RestClient, node: GpuNode, namespace: str, mps_fault: SimulatedBackend
) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "mps-gpu.yaml", namespace, node_name=node.name)

    events = f"/api/v1/namespaces/{namespace}/events"
    selector = "involvedObject.kind=Pod,involvedObject.name=mps,reason=FailedPrepareDynamicResources"

    def failure() -> str | None:
        items: list[JsonObject] = rest.request("GET", events, query={"fieldSelector": selector})["items"]
        return str(items[0]["message"]) if items else None

    message = wait_until(failure, timeout_seconds=60, waiting_for="a FailedPrepareDynamicResources event")
    assert "exited before it was ready" in message
    assert "could not create its context" in message
    claim = pod_claim(rest, rest.get(f"/api/v1/namespaces/{namespace}/pods/mps"), "gpu")
    (device,) = allocated_devices(claim)
    uid = claim["metadata"]["uid"]
    assert not node.driver.spec_path(uid).exists()
    assert policy_of(node, device) == ComputePolicy()
    assert not [d for d in (node.driver.paths.data / "mps").glob(f"{uid}-*")]

    for index in range(len(mps_fault.inventory().gpus)):  # repaired: the kubelet's retry succeeds
        mps_fault.set_mps_broken(index, False)
    wait_running(rest, namespace, "mps")
    assert json.loads(node.driver.spec_path(uid).read_text())["containerEdits"]["mounts"]
    delete_pod(rest, namespace, "mps")
    assert policy_of(node, device) == ComputePolicy()
