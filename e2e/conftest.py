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
import uuid
from collections.abc import Iterator, Mapping

import pytest
from kubernetes import client

from e2e.cluster import (
    ClusterInfo,
    ControlPlane,
    ControlPlaneBinaries,
    FakeNodeFactory,
    RestClient,
    create_fake_node,
    ensure_control_plane_binaries,
)


@contextlib.contextmanager
def _output_shown(config: pytest.Config) -> Iterator[None]:
    """Lets the build's progress reach the terminal: a cold build takes many minutes."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:
        yield
        return
    with capture.global_and_fixture_disabled():
        yield


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
