"""A node on the NVML backend: the driver daemon loads the mock libnvidia-ml.so.1 from its driver root,
as on a host, and reads a DGX H100 from NVIDIA's go-nvml mocks through NVML's C interface. The real
scheduler allocates its GPUs, the kubelet harness prepares them, and an Xid the "hardware" reports
(through the mock's control interface, on the state the daemon shares) taints the GPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e import manifests
from e2e.cluster import ClusterInfo, RestClient
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME, MOCK_NVML_DRIVER_VERSION
from e2e.gpu_node import GpuNode, published_devices
from e2e.workloads import (
    allocated_devices,
    cdi_devices,
    check_cdi_spec,
    delete_pod,
    expected_cdi_ids,
    pod_claim,
    wait_running,
)
from tests.mock_nvml import MockNvml

pytestmark = pytest.mark.e2e

XID_KEY = f"{DRIVER_NAME}/xid"
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def gpu_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A DGX H100 on the mock NVML (replaces conftest.py's simulated node for this module)."""
    base_dir = tmp_path_factory.mktemp("node-nvml")
    node = GpuNode(cluster, kubelet_harness_binary, base_dir, "node-nvml", mock_nvml="dgxh100")
    try:
        node.start()
        yield node
    finally:
        node.remove()


def hardware(node: GpuNode, command: str) -> str:
    """One command of the mock's control interface, on the machine the node's daemon runs on."""
    return MockNvml().control(command, node.driver.paths.mock_nvml_state)


def test_the_node_publishes_the_gpus_nvml_reports(rest: RestClient, node: GpuNode) -> None:
    devices = published_devices(rest, node.name)
    full = sorted(name for name in devices if devices[name]["attributes"]["type"]["string"] == "gpu")
    assert full == [f"gpu-{i}" for i in range(8)]
    # Each GPU also has its counter-free maintenance device, for admin-access claims only.
    assert sorted(name for name in devices if name.endswith("-maintenance")) == sorted(
        f"gpu-{i}-maintenance" for i in range(8)
    )
    gpu = devices["gpu-0"]["attributes"]
    assert gpu["productName"] == {"string": "NVIDIA H100 80GB HBM3"}  # NVIDIA's mock, not our catalog
    assert gpu["driverVersion"] == {"version": MOCK_NVML_DRIVER_VERSION}
    uuids = {device["attributes"]["uuid"]["string"] for name, device in devices.items() if name in full}
    state = MockNvml().state(node.driver.paths.mock_nvml_state)
    assert uuids == {g["uuid"] for g in state["gpus"]}


def test_a_pod_gets_the_gpu_nvml_reports(rest: RestClient, node: GpuNode, namespace: str) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "demo/one-gpu.yaml", namespace, node_name=node.name)
    pod = wait_running(rest, namespace, "one-gpu")
    claim = pod_claim(rest, pod, "gpu")
    assert len(allocated_devices(claim)) == 1
    assert cdi_devices(pod) == {"app": expected_cdi_ids(claim)}
    check_cdi_spec(node, claim)  # the device node and UUID of the GPU, as NVML reports it
    delete_pod(rest, namespace, "one-gpu")


def test_an_xid_from_nvml_taints_the_gpu_until_the_plugin_restarts(rest: RestClient, node: GpuNode) -> None:
    hardware(node, "xid 2 48")

    def tainted() -> bool:
        taints = published_devices(rest, node.name)["gpu-2"].get("taints", [])
        return any(t["key"] == XID_KEY and t.get("value") == "48" for t in taints)

    wait_until(tainted, timeout_seconds=TIMEOUT_S, waiting_for="gpu-2 tainted by Xid 48")
    assert not published_devices(rest, node.name)["gpu-1"].get("taints")
    node.driver.restart()  # NVML sends no recovery event: an Xid lasts until the plugin restarts
    wait_until(
        lambda: not published_devices(rest, node.name)["gpu-2"].get("taints"),
        timeout_seconds=TIMEOUT_S,
        waiting_for="gpu-2 untainted after the restart",
    )


def test_a_gpu_nvml_loses_is_tainted_noexecute_and_untainted_once_reset(
    rest: RestClient, node: GpuNode
) -> None:
    hardware(node, "lose 5")  # NVML answers GPU_IS_LOST for it from now on

    def taints() -> set[tuple[str, str]]:
        return {
            (t["key"], t["effect"]) for t in published_devices(rest, node.name)["gpu-5"].get("taints", [])
        }

    wait_until(
        lambda: (f"{DRIVER_NAME}/gpu-lost", "NoExecute") in taints(),
        timeout_seconds=TIMEOUT_S,
        waiting_for="gpu-5 tainted as lost",
    )
    hardware(node, "reset 5")
    wait_until(lambda: not taints(), timeout_seconds=TIMEOUT_S, waiting_for="gpu-5 untainted after its reset")


def test_time_slicing_changes_the_gpu_nvml_drives_and_unprepare_restores_it(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "time-sliced-gpu.yaml", namespace, node_name=node.name)
    claim = pod_claim(rest, wait_running(rest, namespace, "time-sliced"), "gpu")
    (device,) = allocated_devices(claim)

    def gpu_state() -> dict[str, object]:
        gpus = MockNvml().state(node.driver.paths.mock_nvml_state)["gpus"]
        return next(g for g in gpus if f"gpu-{g['minor']}" == device)

    # Compute mode Default (through NVML) and time slice Long (3, through the driver root's nvidia-smi).
    assert gpu_state().get("timeSlice") == 3
    assert gpu_state().get("computeMode") is None
    delete_pod(rest, namespace, "time-sliced")
    assert gpu_state().get("timeSlice") is None


def test_mps_without_a_daemon_namespace_is_refused_with_the_reason(
    rest: RestClient, node: GpuNode, namespace: str
) -> None:
    manifests.apply_example(rest, manifests.EXAMPLES / "mps-gpu.yaml", namespace, node_name=node.name)
    events = f"/api/v1/namespaces/{namespace}/events"
    selector = "involvedObject.kind=Pod,involvedObject.name=mps,reason=FailedPrepareDynamicResources"

    def failure() -> str | None:
        items = rest.request("GET", events, query={"fieldSelector": selector})["items"]
        return str(items[0]["message"]) if items else None

    message = wait_until(
        failure, timeout_seconds=TIMEOUT_S, waiting_for="a FailedPrepareDynamicResources event"
    )
    assert "this plugin runs no MPS control daemons" in message
    state = MockNvml().state(node.driver.paths.mock_nvml_state)
    assert all(g.get("computeMode") is None for g in state["gpus"])  # nothing was changed
