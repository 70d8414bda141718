"""Fixtures for the real-node tests (marker `real_node`): a control plane started for real kubelets,
one real node (kubelet + containerd + runc, e2e/realnode) and the chart installed on it with Helm.

The node is one per session; the driver is installed per test module (`driver`), so a module that
upgrades or uninstalls it leaves the next one a fresh release. Each test works in its own namespace,
deleted afterwards with its pods. Everything stops on a failure, on Ctrl-C and when the test process
dies (the components die with it), and the node leaves no process, mount or cgroup behind.
"""

from __future__ import annotations

import atexit
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from e2e.cluster import ClusterInfo, ControlPlane, ControlPlaneBinaries
from e2e.cluster.binaries import build_outputs
from e2e.real_node.driver import DriverRelease, install_driver
from e2e.realnode.node import RealNode, RealNodeBinaries, ensure_real_node_binaries

pytestmark = pytest.mark.real_node


@pytest.fixture(scope="session")
def real_node_binaries(control_plane_binaries: ControlPlaneBinaries) -> RealNodeBinaries:
    return ensure_real_node_binaries()


@pytest.fixture(scope="session")
def real_cluster(
    control_plane_binaries: ControlPlaneBinaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ClusterInfo]:
    """A control plane of its own, for real kubelets (ServiceAccount admission, DaemonSet controller)."""
    control_plane = ControlPlane(
        control_plane_binaries, tmp_path_factory.mktemp("real-cluster"), die_with_parent=True, real_nodes=True
    )
    atexit.register(control_plane.stop)
    try:
        yield control_plane.start()
    finally:
        control_plane.stop()
        atexit.unregister(control_plane.stop)


@pytest.fixture(scope="session")
def real_node(
    real_cluster: ClusterInfo, real_node_binaries: RealNodeBinaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    node = RealNode(real_cluster, real_node_binaries, tmp_path_factory.mktemp("real-node"))
    atexit.register(node.stop)
    try:
        node.start()
        yield node
    finally:
        node.stop()
        atexit.unregister(node.stop)


@pytest.fixture(scope="session")
def helm() -> Path:
    return Path(build_outputs("helm")["HELM_BIN_DIR"]) / "helm"


@pytest.fixture(scope="module")
def driver(real_cluster: ClusterInfo, real_node: RealNode, helm: Path) -> Iterator[DriverRelease]:
    """The chart, installed with the built image on the real node; uninstalled after the module."""
    release = install_driver(real_cluster, real_node, helm)
    try:
        yield release
    finally:
        release.uninstall()


@pytest.fixture
def real_api(real_cluster: ClusterInfo) -> Iterator[client.ApiClient]:
    with real_cluster.api_client() as api:
        yield api


def new_namespace(api: client.ApiClient, labels: dict[str, str] | None = None) -> str:
    """A namespace whose `default` ServiceAccount exists (pods are refused until it does)."""
    core = client.CoreV1Api(api)
    name = f"real-{uuid.uuid4().hex[:8]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    deadline = time.monotonic() + 30
    while True:
        try:
            core.read_namespaced_service_account("default", name)
            return name
        except client.ApiException as err:
            if err.status != 404 or time.monotonic() > deadline:
                raise
        time.sleep(0.1)


@pytest.fixture
def namespace(real_api: client.ApiClient) -> Iterator[str]:
    name = new_namespace(real_api)
    yield name
    core = client.CoreV1Api(real_api)
    core.delete_collection_namespaced_pod(name, grace_period_seconds=1)
    core.delete_namespace(name)
