"""Fixtures for tests against the real control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager), built from Go modules by hack/build-kube.sh when missing.

The control plane is one per test session. It is stopped when the session ends -- normally, after a
failure, or on Ctrl-C (pytest tears session fixtures down on KeyboardInterrupt; an atexit hook catches
a teardown that was itself interrupted) -- and the kernel kills the components if the test process
dies without stopping them (PR_SET_PDEATHSIG), so no run leaves processes behind.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import uuid
from collections.abc import Generator, Iterator, Mapping
from pathlib import Path

import pytest
from kubernetes import client

from e2e import manifests
from e2e.cluster import (
    ClusterInfo,
    ControlPlane,
    ControlPlaneBinaries,
    FakeNodeFactory,
    RestClient,
    create_fake_node,
    ensure_control_plane_binaries,
)
from e2e.daemon import Daemon
from e2e.gpu_node import GpuNode
from e2e.harness import ensure_harness_binary


@contextlib.contextmanager
def _output_shown(config: pytest.Config) -> Iterator[None]:
    """Lets the build's progress reach the terminal: a cold build takes many minutes."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        yield
        return
    with capture.global_and_fixture_disabled():
        yield


def pytest_report_header(config: pytest.Config) -> str:
    """Which Kubernetes the run is against: KUBE_VERSION selects a release (hack/e2e-versions.sh)."""
    return f"kubernetes: {os.environ.get('KUBE_VERSION') or 'the release pinned in hack/versions.env'}"


@pytest.fixture(scope="session")
def control_plane_binaries(pytestconfig: pytest.Config) -> ControlPlaneBinaries:
    with _output_shown(pytestconfig):
        return ensure_control_plane_binaries()


@pytest.fixture(scope="session")
def cluster(
    control_plane_binaries: ControlPlaneBinaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterInfo]:
    """The running control plane: server, admin kubeconfig and token, CA file, api_client(), rest()."""
    control_plane = ControlPlane(
        control_plane_binaries, tmp_path_factory.mktemp("cluster"), die_with_parent=True
    )
    atexit.register(control_plane.stop)
    try:
        yield control_plane.start()
    finally:
        control_plane.stop()
        atexit.unregister(control_plane.stop)


@pytest.fixture
def api(cluster: ClusterInfo) -> Iterator[client.ApiClient]:
    """A `kubernetes` client authenticated as the cluster admin."""
    with cluster.api_client() as api_client:
        yield api_client


@pytest.fixture
def rest(cluster: ClusterInfo) -> RestClient:
    """Plain JSON access as the cluster admin (for exact checks on what the API server stores)."""
    return cluster.rest()


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    core = client.CoreV1Api(api)
    name = f"test-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    # No kubelet confirms a graceful pod deletion here, so pods would stay Terminating (and keep their
    # claims reserved) forever: delete them at once, then the namespace.
    core.delete_collection_namespaced_pod(name, grace_period_seconds=0)
    core.delete_namespace(name)


@pytest.fixture
def fake_node(api: client.ApiClient) -> Iterator[FakeNodeFactory]:
    """`fake_node(name, labels=None)` creates a Ready GPU Node (see create_fake_node); all are
    deleted after the test."""
    created: list[str] = []

    def create(name: str, labels: Mapping[str, str] | None = None) -> client.V1Node:
        node = create_fake_node(api, name, labels)
        created.append(name)
        return node

    yield create
    core = client.CoreV1Api(api)
    for name in created:
        core.delete_node(name)


# --- the driver on simulated GPU nodes: the driver process and the kubelet harness -------------------
#
# A test module shares one node (kubelet harness + driver daemon); each test gets its own namespace,
# and leaves the node idle again: its pods gone and every claim unprepared. Processes a test stopped
# are started again for the next test, so one test's failure does not cascade.

_LOG_MARKS = pytest.StashKey[list[tuple[Daemon, int]]]()
_LOG_LINES_SHOWN = 300


@pytest.fixture(scope="session")
def kubelet_harness_binary(pytestconfig: pytest.Config) -> Path:
    with _output_shown(pytestconfig):
        return ensure_harness_binary()


def _device_class(cluster: ClusterInfo, example: Path) -> Iterator[str]:
    """Installs the DeviceClass of an example file, as a user (or the chart) would, and removes it."""
    rest = cluster.rest()
    (device_class,) = manifests.load(example)
    rest.create(manifests.collection("DeviceClass"), device_class)
    yield device_class["metadata"]["name"]
    rest.delete(manifests.object_path(device_class))


@pytest.fixture(scope="session")
def gpu_device_class(cluster: ClusterInfo) -> Iterator[str]:
    """docs/examples/demo/deviceclass.yaml: every full GPU of the driver."""
    yield from _device_class(cluster, manifests.DEMO / "deviceclass.yaml")


@pytest.fixture(scope="module")
def mig_device_class(cluster: ClusterInfo) -> Iterator[str]:
    """docs/examples/deviceclass-mig.yaml: every MIG device of the driver (per module: a module may
    install it itself)."""
    yield from _device_class(cluster, manifests.EXAMPLES / "deviceclass-mig.yaml")


@pytest.fixture(scope="module")
def gpu_node(
    request: pytest.FixtureRequest,
    cluster: ClusterInfo,
    kubelet_harness_binary: Path,
    gpu_device_class: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GpuNode]:
    """A simulated DGX H100 of the test module's own, MIG partitions offered on every GPU: kubelet
    harness and driver daemon running."""
    module = request.module.__name__.rpartition(".")[2].removeprefix("test_")
    name = f"node-{module}".replace("_", "-")
    base_dir = tmp_path_factory.mktemp(name)
    node = GpuNode(cluster, kubelet_harness_binary, base_dir, name, driver_args=["--mig-partitions=all"])
    try:
        node.start()
        yield node
    finally:
        node.remove()


@pytest.fixture
def node(
    request: pytest.FixtureRequest, gpu_node: GpuNode, namespace: str, api: client.ApiClient
) -> Iterator[GpuNode]:
    """The module's node, running, for a test working in `namespace`; the test's pods are deleted and
    the node is idle again afterwards (a claim left prepared fails the test's teardown)."""
    gpu_node.start()
    request.node.stash[_LOG_MARKS] = [(daemon, daemon.log_size()) for daemon in gpu_node.daemons]
    yield gpu_node
    gpu_node.start()  # a test that fails while a process is down must not strand its claims
    client.CoreV1Api(api).delete_collection_namespaced_pod(namespace, grace_period_seconds=0)
    gpu_node.wait_idle()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test that used a GPU node shows what its driver and kubelet logged meanwhile."""
    report: pytest.TestReport = yield
    if report.failed:
        for daemon, offset in item.stash.get(_LOG_MARKS, []):
            lines = daemon.log_since(offset).splitlines()
            shown = "\n".join(lines[-_LOG_LINES_SHOWN:])
            report.sections.append((f"{daemon.name} log ({daemon.log}, last lines)", shown))
    return report
