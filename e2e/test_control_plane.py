"""The test environment itself: a real control plane that validates, allocates, binds and cleans up
the way a production cluster does, and that never leaves a process or a port behind."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from e2e.cluster import (
    GPU_NODE_LABELS,
    ApiError,
    ClusterInfo,
    ControlPlane,
    ControlPlaneBinaries,
    FakeNodeFactory,
    JsonObject,
    RestClient,
    mint_service_account_token,
    processes,
)
from e2e.cluster.binaries import REPO_ROOT
from e2e.cluster.features import device_taint_rule_version, kube_minor

pytestmark = pytest.mark.cluster

RESOURCE_V1 = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_V1}/resourceslices"
CLASSES = f"{RESOURCE_V1}/deviceclasses"


def claims_in(namespace: str) -> str:
    return f"{RESOURCE_V1}/namespaces/{namespace}/resourceclaims"


def pods_in(namespace: str) -> str:
    return f"/api/v1/namespaces/{namespace}/pods"


def driver_for(namespace: str) -> str:
    """A driver name of the test's own: slices and classes are cluster-wide, so a shared name would let
    one test's devices satisfy another test's claims."""
    return f"{namespace}.gpu.dra-driver.dev"


@pytest.fixture
def cluster_objects(rest: RestClient) -> Iterator[list[str]]:
    """Paths of cluster-scoped objects a test creates; they are deleted after it."""
    paths: list[str] = []
    yield paths
    for path in reversed(paths):
        rest.delete(path)


def create(
    rest: RestClient, collection: str, body: JsonObject, cleanup: list[str] | None = None
) -> JsonObject:
    stored = rest.create(collection, body)
    if cleanup is not None:
        cleanup.append(f"{collection}/{stored['metadata']['name']}")
    return stored


def gpu_slice(driver: str, node: str, devices: list[JsonObject], **pool: int) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1, **pool},
            "devices": devices,
        },
    }


def device_class(driver: str) -> JsonObject:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": driver},
        "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{driver}"'}}]},
    }


def is_subset(sent: Any, stored: Any) -> bool:
    """Whether everything in `sent` is in `stored` (which may hold more: defaults, server fields)."""
    if isinstance(sent, dict):
        return isinstance(stored, dict) and all(
            k in stored and is_subset(v, stored[k]) for k, v in sent.items()
        )
    if isinstance(sent, list):
        return isinstance(stored, list) and len(sent) == len(stored) and all(map(is_subset, sent, stored))
    return bool(sent == stored)


# --- the API server -----------------------------------------------------------------------------------


@pytest.mark.kube_versions
def test_api_server_reports_the_pinned_version(cluster: ClusterInfo) -> None:
    request = urllib.request.Request(f"{cluster.server}/version")
    with urllib.request.urlopen(request, context=_tls(cluster), timeout=10) as response:
        version = json.load(response)
    assert version["gitVersion"] == cluster.kube_version
    assert cluster.kube_version.startswith("v1.")


@pytest.mark.kube_versions
def test_resource_api_is_served_in_v1_and_the_older_versions(rest: RestClient, cluster: ClusterInfo) -> None:
    group = rest.get("/apis/resource.k8s.io")
    assert {"v1", "v1beta1", "v1beta2"} <= {v["version"] for v in group["versions"]}
    for version in ("v1", "v1beta1", "v1beta2"):
        served = {r["name"] for r in rest.get(f"/apis/resource.k8s.io/{version}")["resources"]}
        assert {"resourceslices", "deviceclasses", "resourceclaims", "resourceclaimtemplates"} <= served
    taint_rules = {
        r["name"] for r in rest.get(f"/apis/resource.k8s.io/{_taint_rule_version(cluster)}")["resources"]
    }
    assert "devicetaintrules" in taint_rules


def test_admin_kubeconfig_works_for_kubectl(
    cluster: ClusterInfo, control_plane_binaries: ControlPlaneBinaries
) -> None:
    result = subprocess.run(
        [
            str(control_plane_binaries.kubectl),
            "--kubeconfig",
            str(cluster.kubeconfig),
            "auth",
            "whoami",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    user = json.loads(result.stdout)["status"]["userInfo"]
    assert user["username"] == "admin"
    assert "system:masters" in user["groups"]


def test_service_account_token_authenticates_as_the_account_bound_to_its_pod_and_node(
    api: client.ApiClient, rest: RestClient, cluster: ClusterInfo, namespace: str, fake_node: FakeNodeFactory
) -> None:
    fake_node("token-node")
    rest.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "plugin"}})
    pod = {
        "metadata": {"name": "plugin-pod"},
        "spec": {
            "serviceAccountName": "plugin",
            "nodeName": "token-node",
            "containers": [{"name": "plugin", "image": "registry.k8s.io/pause:3.10"}],
        },
    }
    rest.create(pods_in(namespace), pod)

    token = mint_service_account_token(api, namespace, "plugin", bound_pod="plugin-pod")
    as_plugin = cluster.rest(token)
    review = as_plugin.create(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{namespace}:plugin"
    assert user["extra"]["authentication.kubernetes.io/node-name"] == ["token-node"]
    # RBAC is on: an account nobody granted anything may not list nodes.
    with pytest.raises(ApiError) as refused:
        as_plugin.get("/api/v1/nodes")
    assert refused.value.status == 403


# --- nodes and DRA ------------------------------------------------------------------------------------


def test_fake_node_is_ready_untainted_and_labelled_as_a_gpu_node(
    rest: RestClient, fake_node: FakeNodeFactory
) -> None:
    fake_node("gpu-node-labels", {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})

    node = rest.get("/api/v1/nodes/gpu-node-labels")
    labels = node["metadata"]["labels"]
    assert GPU_NODE_LABELS.items() <= labels.items()
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert labels["kubernetes.io/hostname"] == "gpu-node-labels"
    assert {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"] == "True"
    assert not node["spec"].get("taints")
    assert node["status"]["allocatable"]["pods"] == "110"


def test_scheduler_allocates_a_hand_written_slice_and_binds_the_pod(
    rest: RestClient, namespace: str, fake_node: FakeNodeFactory, cluster_objects: list[str]
) -> None:
    driver = driver_for(namespace)
    fake_node("gpu-node-alloc")
    devices = [
        {
            "name": f"gpu-{index}",
            "attributes": {"index": {"int": index}, "productName": {"string": "NVIDIA A100-SXM4-80GB"}},
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for index in range(2)
    ]
    create(rest, SLICES, gpu_slice(driver, "gpu-node-alloc", devices), cluster_objects)
    create(rest, CLASSES, device_class(driver), cluster_objects)
    claim = {
        "metadata": {"name": "second-gpu"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": driver,
                            "selectors": [
                                {"cel": {"expression": f'device.attributes["{driver}"].index == 1'}}
                            ],
                        },
                    }
                ]
            }
        },
    }
    rest.create(claims_in(namespace), claim)
    pod = {
        "metadata": {"name": "workload"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "second-gpu"}],
            "containers": [
                {
                    "name": "app",
                    "image": "registry.k8s.io/pause:3.10",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
        },
    }
    created_pod = rest.create(pods_in(namespace), pod)

    bound = rest.wait_for(pods_in(namespace), "workload", lambda p: bool(p["spec"].get("nodeName")))
    allocated = rest.wait_for(
        claims_in(namespace), "second-gpu", lambda c: "allocation" in c.get("status", {})
    )

    assert bound["spec"]["nodeName"] == "gpu-node-alloc"
    results = allocated["status"]["allocation"]["devices"]["results"]
    assert [(r["request"], r["driver"], r["pool"], r["device"]) for r in results] == [
        ("gpu", driver, "gpu-node-alloc", "gpu-1")
    ]
    assert [r["uid"] for r in allocated["status"]["reservedFor"]] == [created_pod["metadata"]["uid"]]


@pytest.mark.parametrize(
    ("devices", "field", "server_says"),
    [
        pytest.param(
            [{"name": f"gpu-{i}"} for i in range(129)],
            "spec.devices",
            "Too many: 129: must have at most 128 items",
            id="129-devices",
        ),
        pytest.param(
            [{"name": "gpu-0", "attributes": {"driverVersion": {"version": "580.95.05"}}}],
            "spec.devices[0].attributes[driverVersion].version",
            'Invalid value: "580.95.05": must be a string compatible with semver.org spec 2.0.0',
            id="non-semver-version",
        ),
    ],
)
def test_slice_breaking_an_api_limit_is_rejected_by_the_api_server(
    rest: RestClient, namespace: str, devices: list[JsonObject], field: str, server_says: str
) -> None:
    with pytest.raises(ApiError) as rejected:
        rest.create(SLICES, gpu_slice(driver_for(namespace), "no-such-node", devices))

    assert rejected.value.status == 422
    assert rejected.value.body["reason"] == "Invalid"
    causes = rejected.value.body["details"]["causes"]
    assert {"field": field, "message": server_says} in [
        {"field": c["field"], "message": c["message"]} for c in causes
    ]


@pytest.mark.kube_versions
def test_fields_of_the_enabled_dra_features_are_stored(
    rest: RestClient, namespace: str, cluster_objects: list[str], cluster: ClusterInfo
) -> None:
    """A field of a disabled feature is dropped without an error; what comes back shows the gates work."""
    driver = driver_for(namespace)
    node = "features-node"
    counters = gpu_slice(driver, node, [], resourceSliceCount=2)
    del counters["spec"]["devices"]
    counters["metadata"]["name"] = f"{node}-counters"
    counters["spec"]["sharedCounters"] = [{"name": "gpu-0", "counters": {"memory": {"value": "80Gi"}}}]
    partitions = gpu_slice(
        driver,
        node,
        [
            {  # DRAPartitionableDevices: a MIG-like partition consuming the parent GPU's counters
                "name": "gpu-0-mig-1g",
                "consumesCounters": [{"counterSet": "gpu-0", "counters": {"memory": {"value": "10Gi"}}}],
                # DRADeviceTaints
                "taints": [{"key": f"{driver}/unhealthy", "value": "xid-79", "effect": "NoSchedule"}],
            },
            {  # DRAConsumableCapacity: a device several claims share, each taking some memory
                "name": "gpu-1",
                "allowMultipleAllocations": True,
                "capacity": {
                    "memory": {
                        "value": "80Gi",
                        "requestPolicy": {"default": "1Gi", "validRange": {"min": "1Gi"}},
                    }
                },
            },
        ],
        resourceSliceCount=2,
    )
    partitions["metadata"]["name"] = f"{node}-devices"
    extended = device_class(driver)
    extended["spec"]["extendedResourceName"] = f"{driver}/gpu"  # DRAExtendedResource

    objects = [(SLICES, counters), (SLICES, partitions), (CLASSES, extended)]
    if kube_minor(cluster.kube_version) < 35:
        # 1.34: a device consumes counters of its own slice only (docs/kubernetes-versions.md).
        partitions["spec"]["sharedCounters"] = counters["spec"]["sharedCounters"]
        partitions["spec"]["pool"]["resourceSliceCount"] = 1
        objects = objects[1:]
    for collection, body in objects:
        stored = create(rest, collection, body, cluster_objects)
        assert is_subset(body["spec"], stored["spec"]), json.dumps(stored["spec"])


def test_fields_of_the_enabled_claim_features_are_stored(rest: RestClient, namespace: str) -> None:
    # DRAAdminAccess: only honoured in namespaces that carry this label.
    rest.request(
        "PATCH",
        f"/api/v1/namespaces/{namespace}",
        {"metadata": {"labels": {"resource.kubernetes.io/admin-access": "true"}}},
        content_type="application/merge-patch+json",
    )
    driver = driver_for(namespace)
    spec = {
        "devices": {
            "requests": [
                {"name": "monitor", "exactly": {"deviceClassName": driver, "adminAccess": True}},
                {  # DRAPrioritizedList
                    "name": "gpu",
                    "firstAvailable": [
                        {"name": "big", "deviceClassName": driver, "count": 2},
                        {  # DRAConsumableCapacity; DRADeviceTaints (tolerations)
                            "name": "slice",
                            "deviceClassName": driver,
                            "capacity": {"requests": {"memory": "10Gi"}},
                            "tolerations": [{"key": f"{driver}/unhealthy", "operator": "Exists"}],
                        },
                    ],
                },
            ]
        }
    }

    stored = rest.create(claims_in(namespace), {"metadata": {"name": "features"}, "spec": spec})

    assert is_subset(spec, stored["spec"]), json.dumps(stored["spec"])


@pytest.mark.kube_versions
def test_device_taint_rule_is_accepted(rest: RestClient, cluster: ClusterInfo, namespace: str) -> None:
    version = _taint_rule_version(cluster)
    rule = {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {"name": namespace},
        "spec": {
            "deviceSelector": {"driver": driver_for(namespace), "pool": "some-node", "device": "gpu-0"},
            "taint": {"key": "example.com/maintenance", "value": "planned", "effect": "NoExecute"},
        },
    }
    collection = f"/apis/resource.k8s.io/{version}/devicetaintrules"
    try:
        stored = rest.create(collection, rule)
        assert is_subset(rule["spec"], stored["spec"]), json.dumps(stored["spec"])
    finally:
        rest.delete(f"{collection}/{namespace}")


# --- lifecycle: nothing outlives the control plane ------------------------------------------------------


def test_control_plane_comes_up_and_down_repeatedly_without_leaking(
    control_plane_binaries: ControlPlaneBinaries, tmp_path: Path
) -> None:
    for round_ in range(2):
        base = tmp_path / f"round-{round_}"
        with ControlPlane(control_plane_binaries, base) as control_plane:
            info = control_plane.info
            assert info.rest().get("/api/v1/namespaces/default")["metadata"]["name"] == "default"
            assert all(processes.is_running(p) for p in info.processes)

        _assert_left_nothing_behind(info)


def test_cli_up_and_down_manage_a_background_cluster(tmp_path: Path) -> None:
    output = tmp_path / "output"
    cli = [sys.executable, "-m", "e2e.cluster"]
    up = subprocess.run(
        [*cli, "up", "--output-dir", str(output)], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert up.returncode == 0, up.stderr
    info = ClusterInfo.from_json((output / "cluster" / "state.json").read_text())
    try:
        # The processes outlived the command that started them, and the written kubeconfig works.
        assert all(processes.is_running(p) for p in info.processes)
        assert (output / "kubeconfig").exists()
        status = subprocess.run(
            [*cli, "status", "--output-dir", str(output)], cwd=REPO_ROOT, capture_output=True
        )
        assert status.returncode == 0
    finally:
        down = subprocess.run(
            [*cli, "down", "--output-dir", str(output)], cwd=REPO_ROOT, capture_output=True, text=True
        )

    assert down.returncode == 0, down.stderr
    _assert_left_nothing_behind(info)
    assert not (output / "kubeconfig").exists()


_INNER_TEST = """
import os, threading

def test_using_the_cluster(cluster):
    with open(os.environ["CLUSTER_INFO"], "w") as out:
        out.write(cluster.to_json())
    print("CLUSTER-READY", flush=True)
    if os.environ["INNER_TEST"] == "fails":
        raise AssertionError("failing on purpose")
    threading.Event().wait()  # until a signal ends the session
"""


@pytest.mark.parametrize(
    ("inner_test", "stop_signal", "expected_exit", "torn_down"),
    [
        pytest.param("fails", None, 1, True, id="failed-test-tears-down"),
        pytest.param("waits", signal.SIGINT, 2, True, id="ctrl-c-tears-down"),  # 2: pytest's "interrupted"
        # No teardown runs in a killed process: the kernel's parent-death signal ends the components.
        pytest.param("waits", signal.SIGKILL, -signal.SIGKILL, False, id="kill-9-takes-the-cluster-along"),
    ],
)
def test_failed_interrupted_or_killed_test_run_leaves_no_processes(
    tmp_path: Path, inner_test: str, stop_signal: signal.Signals | None, expected_exit: int, torn_down: bool
) -> None:
    """Runs a pytest session whose test uses the `cluster` fixture and fails, is interrupted or is killed."""
    (tmp_path / "test_inner.py").write_text(_INNER_TEST)
    info_file = tmp_path / "cluster.json"
    session = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "e2e.conftest",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            "--basetemp",
            str(tmp_path / "inner"),
            str(tmp_path / "test_inner.py"),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "CLUSTER_INFO": str(info_file), "INNER_TEST": inner_test},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # the signal goes to this session only, as Ctrl-C goes to a terminal's
        preexec_fn=_ctrl_c_as_at_a_terminal,
    )
    try:
        _wait_for_line(session, "CLUSTER-READY", timeout_seconds=300)
        info = ClusterInfo.from_json(info_file.read_text())
        if stop_signal is not None:
            session.send_signal(stop_signal)
        try:
            output, _ = session.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            session.kill()
            output, _ = session.communicate()
            raise AssertionError(f"the inner run had not ended 60 s after {stop_signal}:\n{output}") from None
        assert session.returncode == expected_exit, output
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()

    for record in info.processes:
        assert processes.wait_for_exit(record, timeout_seconds=10), f"{record.name} outlived the test run"
    _assert_left_nothing_behind(info)
    # etcd, stopped last, logs the SIGTERM of an orderly teardown; SIGKILL leaves no last words.
    etcd_log = next(p.log for p in info.processes if p.name == "etcd").read_text()
    assert ("received signal; shutting down" in etcd_log) == torn_down


# --- helpers ------------------------------------------------------------------------------------------


def _ctrl_c_as_at_a_terminal() -> None:
    """Gives the inner run SIGINT's default disposition, which a terminal's foreground job has.

    A run started in the background by a non-interactive shell (`make test &`, most CI runners)
    inherits SIGINT as *ignored*, and Python then installs no KeyboardInterrupt handler: the inner
    run slept through the signal until the timeout killed it, which looked like a slow teardown.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tls(cluster: ClusterInfo) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cluster.ca_file))


def _taint_rule_version(cluster: ClusterInfo) -> str:
    return device_taint_rule_version(cluster.kube_version)


def _wait_for_line(process: subprocess.Popen[str], marker: str, timeout_seconds: float) -> None:
    assert process.stdout is not None
    seen: list[str] = []
    while True:
        readable, _, _ = select.select([process.stdout], [], [], timeout_seconds)
        line = process.stdout.readline() if readable else ""
        if marker in line:
            return
        if not line:
            raise AssertionError(
                "the inner test run ended or stalled before its cluster was up:\n" + "".join(seen)
            )
        seen.append(line)


def _assert_left_nothing_behind(info: ClusterInfo) -> None:
    assert not [p.name for p in info.processes if processes.is_running(p)]
    assert not _processes_mentioning(info.base_dir)
    ports = [info.ports.etcd_client, info.ports.etcd_peer, info.ports.apiserver, info.ports.scheduler]
    assert [port for port in [*ports, info.ports.controller_manager] if not _can_listen(port)] == []


def _processes_mentioning(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (each component gets its state dir there)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(path) in command:
            found.append(command)
    return found


def _can_listen(port: int) -> bool:
    """Whether a new server could listen on the port now (SO_REUSEADDR: as the components do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
        return True
