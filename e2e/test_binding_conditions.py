"""Binding conditions (KEP-5007) on the real scheduler: a pod is bound only once its MIG device exists.

The driver publishes MIG placements with ``bindingConditions: [Ready]`` and ``bindingFailureConditions:
[PrepareFailed]`` (Kubernetes 1.36 and newer, where the gate is on by default). The real scheduler
allocates one, then waits in PreBind; the driver, watching the claims of its pool, creates the MIG
device ahead of the binding and reports the outcome in the claim's ``status.devices``. The simulator's
``mig-creation`` fault holds the creation (slow hardware) or fails it.

Checked where a user looks: the pod's ``spec.nodeName`` and phase, its events, the claim's status, and
the simulated GPUs themselves.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest

from dra_driver.resources.server_rules import rules_for
from dra_driver.simulated.gpus import SimulatedBackend
from e2e import manifests
from e2e.claims import GPU_CLASS, claim_for_gpu, gpu_uuid, pod_using
from e2e.cluster import ClusterInfo, JsonObject, RestClient
from e2e.daemon import wait_until
from e2e.driver import DRIVER_NAME
from e2e.gpu_node import GpuNode
from e2e.test_mig import MIG_CLASS, apply, check_mig_spec, on_gpu, pod, profile_is, template
from e2e.workloads import allocated_devices, delete_pod, pod_claim, pod_path, wait_running

pytestmark = pytest.mark.e2e

PROFILE = "hgx-h100-16"  # test_mig's node, whose helpers read the GPUs as that profile's
SCHEDULER_POLL_S = 5.0  # how often the scheduler looks at the claim while it waits in PreBind


@pytest.fixture(scope="module")
def binding_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    mig_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    if not rules_for(cluster.kube_version).binding_conditions:
        pytest.skip(f"binding conditions are off by default on {cluster.kube_version} (beta from 1.36)")
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-binding"),
        "node-binding",
        profile=PROFILE,
    )
    with node.running():
        yield node


def mig_creation(node: GpuNode, minor: int, mode: Literal["ok", "held", "failing"]) -> None:
    """What `dra-driver simulate mig-creation --gpu <minor> --mode <mode>` does."""
    SimulatedBackend(PROFILE, node.name, node.driver.paths.data).set_mig_creation(minor, mode)


def live_mig_devices(node: GpuNode, minor: int) -> list[str]:
    gpu = SimulatedBackend(PROFILE, node.name, node.driver.paths.data).inventory().gpus[minor]
    return [mig.uuid for mig in gpu.mig_devices]


def our_conditions(claim: JsonObject) -> dict[str, dict[str, Any]]:
    """The conditions of the claim's status.devices entries of our driver, by type."""
    entries = (claim.get("status") or {}).get("devices") or []
    return {c["type"]: c for e in entries if e["driver"] == DRIVER_NAME for c in e.get("conditions") or []}


def allocated_claim(rest: RestClient, namespace: str, name: str) -> JsonObject:
    def allocated() -> JsonObject | None:
        current = rest.get(pod_path(namespace, name))
        if not (current.get("status") or {}).get("resourceClaimStatuses"):
            return None
        claim = pod_claim(rest, current, "gpu")
        return claim if (claim.get("status") or {}).get("allocation") else None

    return wait_until(allocated, timeout_seconds=60, waiting_for=f"the claim of pod {name} to be allocated")


def events_of(rest: RestClient, namespace: str, name: str) -> list[JsonObject]:
    path, query = f"/api/v1/namespaces/{namespace}/events", {"fieldSelector": f"involvedObject.name={name}"}
    items: list[JsonObject] = rest.request("GET", path, query=query)["items"]
    return items


def test_a_pod_waits_in_binding_until_its_mig_device_is_made_then_runs(
    rest: RestClient, binding_node: GpuNode, namespace: str
) -> None:
    node = binding_node
    mig_creation(node, 0, "held")
    try:
        apply(
            rest,
            node,
            namespace,
            template("held", MIG_CLASS, on_gpu(0, node), profile_is("1g.10gb")),
            pod("held", "held"),
        )
        claim = allocated_claim(rest, namespace, "held")
        (device,) = allocated_devices(claim)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["bindingConditions"] == ["Ready"]
        assert result["bindingFailureConditions"] == ["PrepareFailed"]

        # Allocated, reserved for the pod, and the scheduler waits: longer than two of its polls,
        # the pod stays unbound while the MIG device is being made.
        time.sleep(2 * SCHEDULER_POLL_S + 1)
        waiting = rest.get(pod_path(namespace, "held"))
        assert not waiting["spec"].get("nodeName"), "bound before its MIG device existed"
        assert "Ready" not in our_conditions(pod_claim(rest, waiting, "gpu"))
        assert live_mig_devices(node, 0) == []
        reasons = {event["reason"] for event in events_of(rest, namespace, "held")}
        assert "BindingConditionsPending" in reasons
    finally:
        mig_creation(node, 0, "ok")  # the hardware is done

    running = wait_running(rest, namespace, "held")
    assert running["spec"]["nodeName"] == node.name
    claim = pod_claim(rest, running, "gpu")
    assert allocated_devices(claim) == [device]
    ready = our_conditions(claim)["Ready"]
    assert ready["status"] == "True"
    check_mig_spec(node, claim)  # the device the kubelet's prepare handed over is the one made ahead
    assert len(live_mig_devices(node, 0)) == 1

    delete_pod(rest, namespace, "held")
    wait_until(
        lambda: live_mig_devices(node, 0) == [], timeout_seconds=60, waiting_for="the MIG device to go"
    )


def test_a_failed_mig_creation_sends_the_pod_back_to_the_scheduler_with_the_reason(
    rest: RestClient, binding_node: GpuNode, namespace: str
) -> None:
    node = binding_node
    mig_creation(node, 1, "failing")
    try:
        apply(
            rest,
            node,
            namespace,
            template("failing", MIG_CLASS, on_gpu(1, node), profile_is("1g.10gb")),
            pod("failing", "failing"),
        )

        def failure_reported() -> str | None:
            """The scheduler's event naming the driver's reason, once the binding failed."""
            for event in events_of(rest, namespace, "failing"):
                if "simulated fault" in (event.get("message") or ""):
                    return str(event["message"])
            return None

        message = wait_until(failure_reported, timeout_seconds=90, waiting_for="the binding failure's event")
        assert "device binding failed" in message  # the scheduler's words, then the driver's
        assert "reason=PrepareFailed" in message
        current = rest.get(pod_path(namespace, "failing"))
        assert not current["spec"].get("nodeName"), "a pod whose MIG device failed was bound"
        assert live_mig_devices(node, 1) == []  # the failed prepare left nothing behind
    finally:
        mig_creation(node, 1, "ok")  # repaired: the next scheduling attempt succeeds

    running = wait_running(rest, namespace, "failing")
    assert running["spec"]["nodeName"] == node.name
    claim = pod_claim(rest, running, "gpu")
    assert our_conditions(claim)["Ready"]["status"] == "True"
    assert "PrepareFailed" not in our_conditions(claim)  # the allocation was taken back and made anew
    check_mig_spec(node, claim)
    assert len(live_mig_devices(node, 1)) == 1

    delete_pod(rest, namespace, "failing")
    wait_until(
        lambda: live_mig_devices(node, 1) == [], timeout_seconds=60, waiting_for="the MIG device to go"
    )


# --- claims whose opaque config the API server keeps in bytes it will not take back ---------------------
#
# Sent as Python's json.dumps writes it (spaces after `,` and `:`), an opaque config is kept as those
# bytes; the API server then refuses every status write of the claim once allocated
# (e2e/test_claim_status.py, docs/binding-conditions.md). The driver cannot help it; it says why.

CONFIG_API = "resource.dra-driver.dev/v1alpha1"


def with_config(template_body: JsonObject, kind: str) -> JsonObject:
    config = {
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER_NAME, "parameters": {"apiVersion": CONFIG_API, "kind": kind}},
    }
    template_body["spec"]["spec"]["devices"]["config"] = [config]
    return template_body


def create_as_json_dumps(rest: RestClient, node: GpuNode, namespace: str, *objects: JsonObject) -> None:
    """Created as the Python kubernetes client sends them, not as kubectl does."""
    for obj in manifests.pinned(objects, node.name):
        rest.request("POST", manifests.collection(obj["kind"], namespace), json.dumps(obj).encode())


def driver_warnings(node: GpuNode, since: int, event: str) -> list[str]:
    return [line for line in node.driver.daemon.log_since(since).splitlines() if event in line]


def test_a_full_gpu_claim_whose_config_was_sent_as_json_dumps_writes_it_runs_without_its_status_entry(
    rest: RestClient, binding_node: GpuNode, namespace: str
) -> None:
    node = binding_node
    since = node.driver.daemon.log_size()
    create_as_json_dumps(
        rest,
        node,
        namespace,
        with_config(template("dumped", GPU_CLASS, on_gpu(2, node, GPU_CLASS)), "GpuConfig"),
        pod("dumped", "dumped"),
    )
    running = wait_running(rest, namespace, "dumped")  # full GPUs carry no binding conditions
    claim = pod_claim(rest, running, "gpu")
    assert allocated_devices(claim) == ["gpu-2"]

    (warning,) = wait_until(
        lambda: driver_warnings(node, since, "claim status not written, and never will be") or None,
        timeout_seconds=30,
        waiting_for="the driver's warning about the claim's status",
    )
    assert "kubectl" in warning
    assert claim["metadata"]["name"] in warning
    assert our_conditions(pod_claim(rest, running, "gpu")) == {}  # no Healthy entry: refused
    delete_pod(rest, namespace, "dumped")
    assert len(driver_warnings(node, since, "claim status not written")) == 1  # once, not at each retry


def test_a_mig_claim_whose_config_was_sent_as_json_dumps_writes_it_waits_in_binding_and_the_driver_says_why(
    rest: RestClient, binding_node: GpuNode, namespace: str
) -> None:
    node = binding_node
    since = node.driver.daemon.log_size()
    create_as_json_dumps(
        rest,
        node,
        namespace,
        with_config(
            template("dumped-mig", MIG_CLASS, on_gpu(3, node), profile_is("1g.10gb")), "MigDeviceConfig"
        ),
        pod("dumped-mig", "dumped-mig"),
    )
    (warning,) = wait_until(
        lambda: driver_warnings(node, since, "binding conditions not written") or None,
        timeout_seconds=60,
        waiting_for="the driver's warning about the claim's binding conditions",
    )
    assert "kubectl" in warning
    assert len(live_mig_devices(node, 3)) == 1  # made ahead; only the Ready condition cannot be written
    time.sleep(SCHEDULER_POLL_S + 1)
    waiting = rest.get(pod_path(namespace, "dumped-mig"))
    assert not waiting["spec"].get("nodeName")  # and stays so until the scheduler's bindingTimeout
    assert "Ready" not in our_conditions(pod_claim(rest, waiting, "gpu"))

    rest.delete(pod_path(namespace, "dumped-mig"))  # unbound: gone at once, its claim with it
    wait_until(
        lambda: live_mig_devices(node, 3) == [],
        timeout_seconds=60,
        waiting_for="the MIG device made ahead to go",
    )


# --- a GPU share (consumable capacity) waits for its GPU's MPS control daemon ----------------------------

SHARE_PROFILE = "dgx-h100"


@pytest.fixture(scope="module")
def share_node(
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A simulated DGX H100 whose full GPUs are shareable: each share is an MPS client."""
    if not rules_for(cluster.kube_version).binding_conditions:
        pytest.skip(f"binding conditions are off by default on {cluster.kube_version} (beta from 1.36)")
    node = GpuNode(
        cluster,
        kubelet_harness_binary,
        tmp_path_factory.mktemp("node-binding-share"),
        "node-binding-share",
        profile=SHARE_PROFILE,
        driver_args=["--consumable-capacity", "--share-binding-conditions"],
    )
    with node.running():
        yield node


def mps_held(node: GpuNode, minor: int, held: bool) -> None:
    """An MPS control daemon on the GPU is slow to start (held) until released."""
    SimulatedBackend(SHARE_PROFILE, node.name, node.driver.paths.data).set_mps_held(minor, held)


def share_claim(name: str, uuid: str) -> JsonObject:
    claim = claim_for_gpu(name, uuid)
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
    return claim


def test_a_gpu_share_waits_in_binding_until_its_mps_daemon_runs_then_runs(
    rest: RestClient, share_node: GpuNode, namespace: str
) -> None:
    node = share_node
    since = node.driver.daemon.log_size()
    mps_held(node, 0, True)
    try:
        objects = [share_claim("share", gpu_uuid(node, 0)), pod_using("share", "share")]
        manifests.apply(rest, manifests.pinned(objects, node.name), namespace)
        claim = rest.wait_for(
            manifests.collection("ResourceClaim", namespace),
            "share",
            lambda c: bool((c.get("status") or {}).get("allocation")),
        )
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert result["device"] == "gpu-0"
        assert result["shareID"]
        assert result["bindingConditions"] == ["Ready"]
        assert result["bindingFailureConditions"] == ["PrepareFailed"]

        # The daemon is starting and not ready: through two scheduler polls the pod stays unbound.
        time.sleep(2 * SCHEDULER_POLL_S + 1)
        waiting = rest.get(pod_path(namespace, "share"))
        assert not waiting["spec"].get("nodeName"), "bound before its MPS daemon ran"
        assert "Ready" not in our_conditions(pod_claim(rest, waiting, "gpu"))
        assert "BindingConditionsPending" in {
            event["reason"] for event in events_of(rest, namespace, "share")
        }
        assert driver_warnings(node, since, "preparing ahead of the pod's binding")
    finally:
        mps_held(node, 0, False)  # the daemon is up

    running = wait_running(rest, namespace, "share")
    assert running["spec"]["nodeName"] == node.name
    claim = pod_claim(rest, running, "gpu")
    assert our_conditions(claim)["Ready"]["status"] == "True"
    (entry,) = [e for e in claim["status"]["devices"] if e["driver"] == DRIVER_NAME]
    assert entry["shareID"] == result["shareID"]
    # The kubelet's prepare found the share prepared ahead: it did not start a daemon of its own.
    log = node.driver.daemon.log_since(since)
    assert "the kubelet takes it over" in log
    delete_pod(rest, namespace, "share")


def test_a_gpu_share_whose_mps_daemon_fails_goes_back_to_the_scheduler_with_the_reason(
    rest: RestClient, share_node: GpuNode, namespace: str
) -> None:
    node = share_node
    backend = SimulatedBackend(SHARE_PROFILE, node.name, node.driver.paths.data)
    backend.set_mps_broken(1, True)
    try:
        objects = [share_claim("broken", gpu_uuid(node, 1)), pod_using("broken", "broken")]
        manifests.apply(rest, manifests.pinned(objects, node.name), namespace)

        def failure_reported() -> str | None:
            for event in events_of(rest, namespace, "broken"):
                if "simulated fault" in (event.get("message") or ""):
                    return str(event["message"])
            return None

        message = wait_until(failure_reported, timeout_seconds=90, waiting_for="the binding failure's event")
        assert "reason=PrepareFailed" in message
        assert "MPS" in message
        assert not rest.get(pod_path(namespace, "broken"))["spec"].get("nodeName")
    finally:
        backend.set_mps_broken(1, False)

    running = wait_running(rest, namespace, "broken")
    assert running["spec"]["nodeName"] == node.name
    claim = pod_claim(rest, running, "gpu")
    assert our_conditions(claim)["Ready"]["status"] == "True"
    assert "PrepareFailed" not in our_conditions(claim)
    delete_pod(rest, namespace, "broken")
